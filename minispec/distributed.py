"""Training on several processes, one per GPU or CPU slot, on one machine or several:

    torchrun --nproc_per_node=N -m minispec.dflash.train ...            (one machine, N processes)
    torchrun --nnodes=M --node_rank=i --nproc_per_node=N \\
             --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT -m ...        (on each of M machines)

torchrun starts the processes and tells each its place (the environment variables RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Everything here reads that place; a process that torchrun did not
start is rank 0 of 1 and nothing changes for it. The scheme is data parallelism with PyTorch's
DistributedDataParallel, applied by `minispec.training.train_loop`:

    every process holds the whole model, and the same seeded batch of the step (`Settings.batch` rows)
    process r computes the loss of its shard, rows [r * batch / N, (r + 1) * batch / N)
    backward: DDP averages the gradients over the processes (gloo for CPU tensors, NCCL for CUDA tensors)
    every process takes the same optimizer step, so the weights stay identical everywhere
    rank 0 alone writes checkpoints and shows the progress bar

`Settings.batch` is the global batch: a run on N processes computes the same steps as one process (to
float rounding), and its resumable state continues under another N.
"""
from __future__ import annotations

import atexit
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist


def start() -> None:
    """Join the process group torchrun set up (once; nothing without torchrun). CPU tensors travel by gloo,
    CUDA tensors by NCCL, each process on GPU LOCAL_RANK of its machine."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    atexit.register(dist.destroy_process_group)


def world_size() -> int:
    """How many processes train together (1 without torchrun)."""
    start()
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's place among them, 0 .. world_size() - 1."""
    start()
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0: the process that writes files and prints."""
    return rank() == 0


def device() -> torch.device:
    """Where this process trains: its own GPU when there are GPUs, else the CPU."""
    start()
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_of(batch: int) -> slice:
    """The rows of a `batch`-row batch this process computes: an equal contiguous share."""
    n, r = world_size(), rank()
    if batch % n:
        raise ValueError(f"a batch of {batch} rows does not split evenly over {n} processes: give a batch that is a "
                         f"multiple of {n} (the batch is the global one, shared out over the processes)")
    return slice(r * batch // n, (r + 1) * batch // n)


def shard(rows: torch.Tensor) -> torch.Tensor:
    """This process's rows of a batch `rows` [B, ...] (`shard_of`)."""
    return rows[shard_of(len(rows))]


def barrier() -> None:
    """Wait until every process gets here."""
    if world_size() > 1:
        dist.barrier()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def mean_over_processes(record):
    """A step's record (a number, or a dict of numbers and lists of numbers, its other values rank 0's) averaged
    over the processes, so that the history holds the whole batch's numbers whatever the number of processes."""
    if world_size() == 1:
        return record
    if not isinstance(record, dict):
        return mean_over_processes({"value": record})["value"]
    lists = {k for k, v in record.items() if isinstance(v, (list, tuple)) and v and all(map(_is_number, v))}
    keys = [k for k, v in record.items() if k in lists or _is_number(v)]
    flat = torch.tensor([float(x) for k in keys for x in (record[k] if k in lists else [record[k]])],
                        dtype=torch.float64)
    dist.all_reduce(flat)  # a CPU tensor: it goes through gloo whatever the GPUs
    means, out = (flat / world_size()).tolist(), dict(record)
    for k in keys:
        n = len(record[k]) if k in lists else 1
        out[k] = type(record[k])(means[:n]) if k in lists else means[0]
        means = means[n:]
    return out


@contextmanager
def main_first():
    """Rank 0 runs the block first (it fills the on-disk caches: replies, tap features), then the others run it
    (and read what rank 0 cached) instead of all computing the same thing at once."""
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()
