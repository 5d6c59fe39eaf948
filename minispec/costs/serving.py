"""Serving: batch size, concurrency and memory per request.

`minispec.costs.speedup` prices one cycle at batch 1. A server decodes many sequences at once, and one forward then
moves two kinds of bytes and does one kind of work:

    weights      read ONCE per forward, whatever the batch (all of a dense model; the experts the
                 batch's tokens route to, for a mixture of experts)
    KV / state   read per sequence: the KV cache of its context, the Mamba state (read and written)
    FLOPs        2 · active parameters per token, for every token of every sequence

and takes max(bytes / bandwidth, FLOPs / peak), the roofline. At batch 1 the weights dominate and a
verify forward over K + 1 tokens costs about as much as a decode step over 1: speculation buys ~tau.
As the batch grows the forward becomes compute-bound, a verify forward costs up to K + 1 decode steps,
and the speedup tau · C_t / (C_d + C_v) falls below 1. For Bolt E4B this roofline still gives 1.85x at batch 64
on an H200 (break-even at batch 195), so it does not by itself explain the write-up's 64-sequence throughput
setup without speculation (`max-num-seqs 1` with it for latency); costs it leaves out and a lower tau under
throughput traffic may.
Attention FLOPs over the context and activations are left out: both grow the per-sequence part, which
only brings the break-even batch earlier.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from minispec.costs.dflash import E4B_DFLASH, dflash_kv_cache_bytes, dflash_param_count
from minispec.costs.mamba import SUPER_MAMBA2, SUPER_MAMBA_LAYERS, spec_state_traffic
from minispec.costs.payloads import nvfp4_bytes
from minispec.costs.speedup import check_tau, speedup
from minispec.costs.units import BF16_BYTES, GB, check_fraction, check_nonnegative, check_positive, check_positive_int
from minispec.ssm.config import Mamba2Config


@dataclass(frozen=True)
class Accelerator:
    """One GPU as the roofline sees it: memory, memory bandwidth and dense BF16 peak."""

    name: str
    memory_bytes: float
    bandwidth: float  # bytes / s
    flops: float  # dense BF16 FLOP / s

    def __post_init__(self) -> None:
        check_positive(memory_bytes=self.memory_bytes, bandwidth=self.bandwidth, flops=self.flops)


# NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16 (1,979 with sparsity).
H200 = Accelerator("H200", 141 * GB, 4.8e12, 989e12)
# NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s for 8 GPUs, i.e. 180 GB and 8 TB/s each;
# 2.25 PFLOPS dense BF16 per GPU (HGX B200: 36 PFLOPS FP16/BF16 for 8, with sparsity).
B200 = Accelerator("B200", 180 * GB, 8.0e12, 2.25e15)


@dataclass(frozen=True)
class ServedModel:
    """What one forward of a model costs per token and per sequence, and what it keeps per request.

    weight_bytes:          all weights as stored (what must fit in memory)
    active_weight_bytes:   weights one token reads (a dense model reads them once per forward, whatever the
                           number of tokens; embedding tables are looked up, not read whole)
    routed:                a mixture of experts: more tokens in a forward route to more experts (see
                           `weight_bytes_read`)
    flops_per_token:       2 · active parameters
    kv_bytes_per_token:    KV cache per context token and sequence on the layers whose cache grows
                           with the context
    window_kv_bytes_per_token, window: KV per token on sliding-window layers, which keep `window` tokens
    mamba, mamba_layers:   the Mamba-2 mixer (None: none) and how many layers have one
    spec_strategy:         how a verify window keeps their state, "per-position" (T states) or "replay"
                           (checkpoint + records), as `minispec.costs.mamba` counts it
    """

    name: str
    weight_bytes: float
    active_weight_bytes: float
    flops_per_token: float
    kv_bytes_per_token: float = 0.0
    window_kv_bytes_per_token: float = 0.0
    window: int = 1
    routed: bool = False
    mamba: Mamba2Config | None = None
    mamba_layers: int = 0
    spec_strategy: str = "per-position"

    def __post_init__(self) -> None:
        check_positive(weight_bytes=self.weight_bytes, active_weight_bytes=self.active_weight_bytes,
                        flops_per_token=self.flops_per_token)
        check_nonnegative(kv_bytes_per_token=self.kv_bytes_per_token,
                           window_kv_bytes_per_token=self.window_kv_bytes_per_token)
        if self.spec_strategy not in ("per-position", "replay"):
            raise ValueError(f"spec_strategy must be 'per-position' or 'replay', got {self.spec_strategy!r}")
        check_positive_int(window=self.window)
        if self.active_weight_bytes > self.weight_bytes:
            raise ValueError(f"active_weight_bytes ({self.active_weight_bytes}) cannot exceed weight_bytes "
                             f"({self.weight_bytes})")

    def kv_bytes(self, context_len: int) -> float:
        """KV cache of one sequence holding `context_len` tokens."""
        check_nonnegative(context_len=context_len)
        return self.kv_bytes_per_token * context_len + self.window_kv_bytes_per_token * min(context_len, self.window)

    def state_bytes(self, tokens_per_seq: int = 1) -> float:
        """Mamba memory of one request while verifying windows of `tokens_per_seq` tokens (`mamba_request_bytes`)."""
        if self.mamba is None:
            return 0.0
        return mamba_request_bytes(self.mamba, self.mamba_layers, tokens_per_seq, self.spec_strategy)

    def state_traffic(self, tokens_per_seq: int = 1) -> float:
        """Mamba bytes one sequence reads + writes in a forward over `tokens_per_seq` tokens, all layers:
        a decode step reads and writes one state; a verify window moves what `spec_state_traffic` counts for
        the strategy, with the whole window kept (the most flushes replay can need)."""
        if self.mamba is None:
            return 0.0
        strategy = "per-position" if tokens_per_seq == 1 else self.spec_strategy
        return self.mamba_layers * _state_traffic(self.mamba, tokens_per_seq, strategy)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes one forward over `tokens` tokens in all (batch · tokens per sequence) reads.

        Dense: `active_weight_bytes`, once. Mixture of experts, with every weight treated as a routed expert
        that each token picks with probability f = active / total, independently of the other tokens:
        total · (1 - (1 - f)^tokens), which is `active_weight_bytes` for one token and approaches all the
        weights for a large batch. Real routing shares experts between neighbouring tokens and MoE models
        have shared parts, so this is an upper bound on the traffic of a small forward: a verify forward of
        K + 1 tokens then reads up to K + 1 times the weights of a decode step, which is why speculation
        buys a mixture of experts less than tau even at batch 1.
        """
        check_positive_int(tokens=tokens)
        if not self.routed:
            return self.active_weight_bytes
        f = self.active_weight_bytes / self.weight_bytes
        return self.weight_bytes * (1 - (1 - f) ** tokens)


# Gemma 4 E4B, the target of Nemotron 3.5 Bolt E4B (its published DFlash drafter config: 42 target layers,
# hidden 2560, vocab 262,144). From Gemma 4's public configs (Megatron-Bridge's Gemma 4 E4B recipe;
# google/gemma.cpp PR #919): ~3.8 B parameters without the per-layer embeddings, 2 KV heads of 256 on
# sliding layers (window 512) and of 512 on the full-attention layers (every sixth), and the last 18 layers
# reuse the K and V of the last earlier layer of their kind (num_kv_shared_layers 18), so of its 7 full-attention
# and 35 sliding layers only 24 keep a cache: 4 full (5, 11, 17, 23) and 20 sliding. The drafter taps the outputs
# of full layers 5, 11, 17, 23 and 35 (35 computes its output with layer 23's K and V).
# BF16 weights and KV; stored weights counted at 7.5 B parameters (with the per-layer
# embeddings, as fairseq2's Gemma 4 table lists E4B).
E4B_TARGET = ServedModel(
    name="Bolt E4B target (Gemma 4 E4B)",
    weight_bytes=7.5e9 * BF16_BYTES,
    active_weight_bytes=3.8e9 * BF16_BYTES,
    flops_per_token=2 * 3.8e9,
    kv_bytes_per_token=4 * 2 * 2 * 512 * BF16_BYTES,
    window_kv_bytes_per_token=20 * 2 * 2 * 256 * BF16_BYTES,
    window=512,
)


@functools.lru_cache(maxsize=64)
def _state_traffic(shape: Mamba2Config, window: int, strategy: str) -> float:
    """Bytes one layer reads + writes per verify window of `window` tokens, all of them kept."""
    t = spec_state_traffic(shape, window, window, strategy)
    return t.read_per_step + t.written_per_step


def e4b_dflash_drafter() -> ServedModel:
    """Bolt E4B's DFlash drafter as served: NVFP4 weights (1,031,568,640 parameters at 4.5 bits), its
    20 MiB draft KV cache per sequence (every layer slides over 1024 tokens), dense."""
    n = dflash_param_count(E4B_DFLASH).total
    kv = dflash_kv_cache_bytes(E4B_DFLASH) / E4B_DFLASH.sliding_window
    return ServedModel(name="Bolt E4B DFlash drafter", weight_bytes=nvfp4_bytes(n), active_weight_bytes=nvfp4_bytes(n),
                       flops_per_token=2 * n, window_kv_bytes_per_token=kv, window=E4B_DFLASH.sliding_window)


def super_target(spec_strategy: str = "per-position") -> ServedModel:
    """Nemotron 3 Super (120 B parameters, 12 B active per token) with NVFP4 weights at the Super/Lightning
    paper's 4.82 bits per parameter, a mixture of experts, and its 40 Mamba-2 layers (fp32 SSM state, bf16
    conv window) kept per position or by checkpoint + replay while verifying.

    Its attention layers' KV cache is left out (the sources give the Mamba shapes, not the attention
    ones): memory per request is a lower bound, requests that fit an upper bound.
    """
    bits = 4.82
    return ServedModel(name="Nemotron 3 Super", weight_bytes=120e9 * bits / 8, active_weight_bytes=12e9 * bits / 8,
                       flops_per_token=2 * 12e9, routed=True, mamba=SUPER_MAMBA2, mamba_layers=SUPER_MAMBA_LAYERS,
                       spec_strategy=spec_strategy)


def mamba_request_bytes(shape: Mamba2Config, num_layers: int, spec_window: int = 1, strategy: str = "per-position",
                        capacity: int = 16) -> float:
    """Mamba memory of one request over `num_layers` layers (SSM state + conv window per layer).

    Plain decoding (spec_window 1) keeps one state. Speculative verification over a window of T tokens keeps
    T states per layer with per-position states (vLLM / SGLang natively), or one checkpoint plus a ring of
    `capacity` records with checkpoint + replay (`spec_state_traffic`'s memory_per_request).
    Super, T = 4: 4 · (4 MiB + 60 KiB) per layer natively; replay 4 MiB + 16 records.
    """
    check_positive_int(num_layers=num_layers, spec_window=spec_window)
    if spec_window == 1:
        strategy = "per-position"
    return num_layers * spec_state_traffic(shape, spec_window, 1, strategy, capacity).memory_per_request


def forward_seconds(model: ServedModel, hw: Accelerator, batch: int, tokens_per_seq: int = 1,
                    context_len: int = 0) -> float:
    """Roofline time of one forward of `batch` sequences, `tokens_per_seq` new tokens each, after
    `context_len` tokens of context: max(bytes / bandwidth, FLOPs / peak), with
    bytes = weights read (once) + batch · (KV of the context + Mamba state read and written) and
    FLOPs = batch · tokens_per_seq · flops_per_token.
    """
    check_positive_int(batch=batch, tokens_per_seq=tokens_per_seq)
    check_nonnegative(context_len=context_len)
    tokens = batch * tokens_per_seq
    per_sequence = model.kv_bytes(context_len) + model.state_traffic(tokens_per_seq)
    moved = model.weight_bytes_read(tokens) + batch * per_sequence
    return max(moved / hw.bandwidth, tokens * model.flops_per_token / hw.flops)


@dataclass(frozen=True)
class Drafting:
    """How one speculative cycle drafts: K drafts, then one verify forward over K + 1 tokens per sequence.

    drafter:         the draft model, priced by `forward_seconds` like the target (None: see draft_ratio)
    passes:          drafter forwards per cycle (DFlash: 1; a recursive MTP head or EAGLE: K)
    tokens_per_pass: tokens per sequence in one pass (DFlash: the whole block, K + 1)
    draft_ratio:     without a drafter model, one pass costs this fraction of a target decode step at the
                     same batch (0: free drafts, as prompt lookup)
    """

    tau: float
    num_drafts: int
    drafter: ServedModel | None = None
    passes: int = 1
    tokens_per_pass: int = 1
    draft_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_tau(self.tau)
        check_positive_int(num_drafts=self.num_drafts, passes=self.passes, tokens_per_pass=self.tokens_per_pass)
        check_nonnegative(draft_ratio=self.draft_ratio)
        if self.tau > self.num_drafts + 1:
            raise ValueError(f"tau ({self.tau}) cannot exceed num_drafts + 1 = {self.num_drafts + 1}")


def speedup_at_batch(target: ServedModel, hw: Accelerator, batch: int, drafting: Drafting,
                     context_len: int = 0) -> float:
    """`minispec.costs.speedup`'s speedup tau · C_t / (C_d + C_v), with each cost a forward at this batch:
    C_t = one decode step, C_v = a forward over K + 1 tokens per sequence, C_d = the drafter's passes.
    """
    c_target = forward_seconds(target, hw, batch, 1, context_len)
    c_verify = forward_seconds(target, hw, batch, drafting.num_drafts + 1, context_len)
    if drafting.drafter is None:
        c_draft = drafting.passes * drafting.draft_ratio * c_target
    else:
        c_draft = drafting.passes * forward_seconds(drafting.drafter, hw, batch, drafting.tokens_per_pass, context_len)
    return speedup(drafting.tau, c_target, c_draft, c_verify)


def break_even_batch(target: ServedModel, hw: Accelerator, drafting: Drafting, context_len: int = 0,
                     max_batch: int = 4096) -> int | None:
    """The batch from which on speculation stops paying: the smallest batch above the one where it pays most
    (on the grid of powers of two) with speedup <= 1, found by bisection. 1 if it pays at no batch on the grid;
    None if it still pays at max_batch.

    The speedup need not fall from batch 1: a mixture of experts pays little at batch 1 (a verify forward
    reads more experts than a decode step) and more once every forward reads all the experts anyway.
    """
    check_positive_int(max_batch=max_batch)

    def gain(batch: int) -> float:
        return speedup_at_batch(target, hw, batch, drafting, context_len)

    grid = [2**i for i in range(max_batch.bit_length()) if 2**i <= max_batch]
    peak = max(grid, key=gain)
    if gain(peak) <= 1:
        return 1
    if gain(max_batch) > 1:
        return None
    low, high = peak, next((b for b in grid if b > peak and gain(b) <= 1), max_batch)  # gain(low) > 1 >= gain(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if gain(mid) > 1 else (low, mid)
    return high


def measured_break_even_batch(step_seconds: Mapping[int, tuple[float, float]], tau: float,
                              draft_ratio: float = 0.0) -> int | None:
    """The smallest measured batch at which speculation stops paying, from timings of the real forwards.

    step_seconds: batch -> (seconds of a decode step, seconds of a verify forward over K + 1 tokens), as
    `minispec.bench.timing.timed` measures them; drafting costs draft_ratio decode steps per cycle.
    None if speculation pays at every measured batch.
    """
    for batch in sorted(step_seconds):
        c_target, c_verify = step_seconds[batch]
        if speedup(tau, c_target, draft_ratio * c_target, c_verify) <= 1:
            return batch
    return None


def memory_per_request(target: ServedModel, context_len: int, drafter: ServedModel | None = None,
                       spec_window: int = 1) -> float:
    """Bytes one request keeps: the target's KV cache at `context_len` and its Mamba state while verifying
    windows of `spec_window` tokens (1: plain decoding), plus the drafter's cache (Bolt E4B's DFlash
    drafter: 20 MiB once the context fills its 1024-token window)."""
    check_nonnegative(context_len=context_len)
    total = target.kv_bytes(context_len) + target.state_bytes(spec_window)
    if drafter is not None:
        total += drafter.kv_bytes(context_len)
    return total


def requests_that_fit(hw: Accelerator, weight_bytes: float, request_bytes: float, utilization: float = 0.9) -> int:
    """How many requests one GPU holds: floor((utilization · memory - weights) / bytes per request).

    `utilization` is the share of memory the server may use (vLLM's gpu_memory_utilization defaults to 0.9);
    activations and CUDA graphs come out of the rest. 0 when the weights alone do not fit.
    """
    check_positive(weight_bytes=weight_bytes, request_bytes=request_bytes)
    check_fraction(utilization=utilization)
    free = utilization * hw.memory_bytes - weight_bytes
    return max(0, math.floor(free / request_bytes))
