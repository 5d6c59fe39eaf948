"""Checkers of exercise 06x: the roofline cost of one forward at a batch, and the batch at which speculation stops
paying. The answers are compared with the project's cost model, `minispec.costs` (section 7).

    forward_seconds(batch, tokens_per_seq, weight_bytes, seq_bytes, flops_per_token, bandwidth, peak_flops) -> float

One forward of a dense model over `batch` sequences of `tokens_per_seq` new tokens each reads the weights once,
each sequence's `seq_bytes` (its KV cache) once, and does `flops_per_token` FLOPs per token; it takes
max(bytes / bandwidth, FLOPs / peak_flops) seconds.

    break_even_batch(cost, tau, num_drafts, draft_ratio, max_batch) -> int | None

`cost(batch, tokens_per_seq)` gives the seconds of one forward. A cycle drafts (draft_ratio decode steps) and
verifies num_drafts + 1 tokens per sequence in one forward, and emits tau tokens: speedup = tau · C_t / (C_d + C_v).
The answer is the smallest batch in 1 .. max_batch at which the speedup is <= 1, or None if it pays at every one.
"""
from __future__ import annotations

import numbers

from minispec import costs
from minispec.exercises.result import Wrong, call

# Bolt E4B's target as the cost model prices it at 2048 tokens of context: 3.8 B active BF16 parameters and a
# 52 MiB KV cache per sequence; the H200's bandwidth and dense BF16 peak.
E4B = {"weight_bytes": costs.E4B_TARGET.active_weight_bytes, "seq_bytes": costs.E4B_TARGET.kv_bytes(2048),
       "flops_per_token": costs.E4B_TARGET.flops_per_token}
H200 = {"bandwidth": costs.H200.bandwidth, "peak_flops": costs.H200.flops}
B200 = {"bandwidth": costs.B200.bandwidth, "peak_flops": costs.B200.flops}
_CONTEXT = 1024  # the served model holds seq_bytes as seq_bytes / 1024 per token of a 1024-token context: exact


def _served(weight_bytes, seq_bytes, flops_per_token) -> costs.ServedModel:
    return costs.ServedModel("exercise", weight_bytes=weight_bytes, active_weight_bytes=weight_bytes,
                             flops_per_token=flops_per_token, kv_bytes_per_token=seq_bytes / _CONTEXT)


def _gpu(bandwidth, peak_flops) -> costs.Accelerator:
    return costs.Accelerator("exercise", memory_bytes=1e12, bandwidth=bandwidth, flops=peak_flops)


def _reference_seconds(batch, tokens_per_seq, weight_bytes, seq_bytes, flops_per_token, bandwidth, peak_flops):
    return costs.forward_seconds(_served(weight_bytes, seq_bytes, flops_per_token), _gpu(bandwidth, peak_flops),
                                 batch, tokens_per_seq, _CONTEXT)


def _seconds_variant(batch, tokens_per_seq, weight_bytes, seq_bytes, flops_per_token, bandwidth, peak_flops, *,
                     mistake: str) -> float:
    """The roofline with one of the usual mistakes in it."""
    weights = batch * weight_bytes if mistake == "weights_per_sequence" else weight_bytes
    sequences = 1 if mistake == "kv_once" else batch * tokens_per_seq if mistake == "kv_per_token" else batch
    tokens = batch if mistake == "flops_per_sequence" else batch * tokens_per_seq
    memory = (weights + sequences * seq_bytes) / bandwidth
    compute = tokens * flops_per_token / peak_flops
    return {"sum": memory + compute, "min": min(memory, compute)}.get(mistake, max(memory, compute))


SECONDS_MISTAKES = {
    "sum": "the two times are added: a forward waits for the slower of memory and compute, so take the max",
    "weights_per_sequence": "the weights are counted once per sequence: one forward reads them once, whatever the "
                            "batch (that is why batching is cheap)",
    "kv_once": "seq_bytes is counted once: every sequence reads its own KV cache, batch · seq_bytes in all",
    "kv_per_token": "seq_bytes is counted once per new token: a forward over several tokens of a sequence reads its "
                    "KV cache once, batch · seq_bytes in all",
    "flops_per_sequence": "the FLOPs count one token per sequence: every new token costs flops_per_token, "
                          "batch · tokens_per_seq tokens in all",
    # last: on a compute-bound forward, the min gives what counting one token per sequence gives
    "min": "you took the smaller of the two times: a forward waits for the slower one, so take the max",
}

# (batch, tokens_per_seq): batch 1 memory-bound, with 1 and 8 tokens; batch 64 memory-bound for one token and
# compute-bound for 8; batch 512 compute-bound.
_SECONDS_CASES = ((1, 1), (1, 8), (64, 1), (64, 8), (512, 8))


def _as_number(out, what: str) -> float:
    if isinstance(out, bool) or not isinstance(out, numbers.Real):
        raise Wrong(f"{what} must be a number of seconds (a float), got {type(out).__name__}")
    return float(out)


def check_forward_seconds(fn) -> str:
    for batch, tokens in _SECONDS_CASES:
        args = (batch, tokens, *E4B.values(), *H200.values())
        want = _reference_seconds(*args)
        what = f"forward_seconds(batch={batch}, tokens_per_seq={tokens}, Bolt E4B on an H200)"
        got = _as_number(call(fn, *args), what)
        if abs(got - want) <= 1e-9 * want:
            continue
        for mistake, message in SECONDS_MISTAKES.items():
            if abs(got - _seconds_variant(*args, mistake=mistake)) <= 1e-9 * want:
                raise Wrong(f"{what}: {message}.")
        if abs(got * 1e-3 - want) <= 1e-9 * want:
            raise Wrong(f"{what} = {got:.4g}: that looks like milliseconds; return seconds.")
        raise Wrong(f"{what} = {got:.6g} s, the cost model gives {want:.6g} s. bytes = weight_bytes + batch · "
                    "seq_bytes, FLOPs = batch · tokens_per_seq · flops_per_token, seconds = max(bytes / bandwidth, "
                    "FLOPs / peak_flops).")
    return ("Equal to minispec.costs.forward_seconds on 5 forwards of Bolt E4B on an H200, memory-bound and "
            "compute-bound.")


def _cost(model: dict, gpu: dict):
    """cost(batch, tokens_per_seq) -> seconds, as the cost model prices one forward (what the learner is given)."""
    served, hw = _served(**model), _gpu(**gpu)

    def cost(batch: int, tokens_per_seq: int) -> float:
        return costs.forward_seconds(served, hw, batch, tokens_per_seq, _CONTEXT)
    return cost


def _reference_break_even(model, gpu, tau, num_drafts, draft_ratio, max_batch):
    drafting = costs.Drafting(tau=tau, num_drafts=num_drafts, draft_ratio=draft_ratio)
    return costs.break_even_batch(_served(**model), _gpu(**gpu), drafting, _CONTEXT, max_batch)


def _break_even_variant(cost, tau, num_drafts, draft_ratio, max_batch, *, mistake: str):
    """A linear scan with one of the usual mistakes in it."""
    verify_tokens = num_drafts if mistake == "verify_k_tokens" else num_drafts + 1
    ratio = 0.0 if mistake == "no_draft_cost" else draft_ratio
    batches = [2**i for i in range(max_batch.bit_length())] if mistake == "powers_of_two" else range(1, max_batch + 1)
    for b in batches:
        c_t = cost(b, 1)
        if tau * c_t / (ratio * c_t + cost(b, verify_tokens)) <= 1:
            return max(b - 1, 1) if mistake == "last_paying" else b
    return max_batch if mistake == "max_batch_not_none" else None


BREAK_EVEN_MISTAKES = {
    "last_paying": "that is the last batch at which speculation still pays; the answer is the first at which it "
                   "no longer does (speedup <= 1)",
    "verify_k_tokens": "the verify forward is priced over num_drafts tokens: it runs the last accepted token plus the "
                       "drafts, num_drafts + 1 tokens per sequence",
    "no_draft_cost": "drafting is free in your speedup: a cycle also costs draft_ratio decode steps, "
                     "C_d = draft_ratio · cost(batch, 1)",
    "powers_of_two": "only powers of two are tried: every batch from 1 to max_batch counts",
    "max_batch_not_none": "when speculation still pays at max_batch there is no break-even batch: return None",
}

# (model, GPU, tau, num_drafts, draft_ratio, max_batch, what it shows)
_BREAK_EVEN_CASES = (
    (E4B, H200, 4.01, 7, 0.1, 4096, "Bolt E4B, tau 4.01, 7 drafts, drafts at 0.1 decode steps, H200"),
    (E4B, B200, 2.0, 3, 0.1, 4096, "Bolt E4B, tau 2, 3 drafts, drafts at 0.1 decode steps, B200"),
    (E4B, H200, 1.0, 3, 0.5, 4096, "tau 1 with drafting that costs: it pays at no batch"),
    (E4B, H200, 2.0, 1, 0.0, 8, "tau 2, one free draft, up to batch 8: it still pays at every batch"),
)


def check_break_even_batch(fn) -> str:
    for model, gpu, tau, k, ratio, max_batch, what in _BREAK_EVEN_CASES:
        want = _reference_break_even(model, gpu, tau, k, ratio, max_batch)
        cost = _cost(model, gpu)
        where = f"{what} (max_batch {max_batch})"
        got = call(fn, cost, tau, k, ratio, max_batch)
        if got is not None and (isinstance(got, bool) or not isinstance(got, numbers.Integral)):
            raise Wrong(f"{where}: return a batch (an int) or None, got {type(got).__name__}")
        if got == want:
            continue
        for mistake, message in BREAK_EVEN_MISTAKES.items():
            if got == _break_even_variant(cost, tau, k, ratio, max_batch, mistake=mistake):
                raise Wrong(f"{where}: you returned {got}, the cost model gives {want}: {message}.")
        raise Wrong(f"{where}: you returned {got}, the cost model gives {want}. speedup(batch) = tau · C_t / "
                    "(draft_ratio · C_t + C_v) with C_t = cost(batch, 1), C_v = cost(batch, num_drafts + 1); the "
                    "answer is the first batch with speedup <= 1.")
    return ("Equal to minispec.costs.break_even_batch on 4 cases: two targets and GPUs, one that never pays and "
            "one that always does.")
