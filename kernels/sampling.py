"""Temperature, top-k and top-p in one Triton kernel, without sorting.

Kernel for `minispec.speculative.sampling.sampling_probs`, with the same signature and the same kept sets.

One program owns one row of logits and streams it in BLOCK-wide chunks, so any vocabulary size
works (V = 262,144 included) without holding the row in registers. Sorting a row that long for every
token is what makes naive top-k / top-p slow; here both cut-offs are thresholds found by bisection:

    top-k: the largest t with  count(z >= t) >= k     is exactly the k-th largest z;
    top-p: the smallest t with mass(p > t) < top_p    keeps exactly the tokens i whose strictly
           more likely tokens hold mass < top_p (the reference's rule, see top_p_mask).

The bisection runs over integers, not floats. Reading a float32's bits as an int32 and flipping the
magnitude bits of negative numbers gives a map that keeps the order (a < b iff key(a) < key(b)), so
at most 32 halvings of the int32 range land on one exact float: the threshold equals what the
reference's sort finds, bit for bit. Each halving is one pass over the row (a count or a sum), so a
row is read about 70 times; it stays in L2, and nothing is sorted.

Top-p compares a sum of up to V probabilities with top_p, so its precision decides which tokens
survive at the edge of the nucleus. In float32, adding to a mass near 1 rounds by up to 6e-8, as
much as a tail token of p ≈ 1e-7 weighs, so which tail tokens survive top_p = 0.99999 would depend on
the order of the additions. So the kernel works as the reference does, in float64 wherever it sums:
exp(z) and the softmax denominator are float64, each probability is rounded once to
float32 (the p that is returned and sampled), the masses of those float32 p are float64 sums, and
top_p is read as a float64 from a one-element tensor. (Not a scalar argument annotated `tl.float64`:
Triton 3.8's interpreter ignores that annotation and rounds a Python float to float32, which moves
0.99999 by 2.5e-8 and with it the cut through a tail of tokens near 1e-7.) The probabilities are
written to `out` once and the top-p passes read them back from there. Kernel and reference then keep
the same tokens unless some token's mass above lies within the two float64 sums' rounding
(about V · 2**-53) of top_p.
"""
import torch
import triton
import triton.language as tl

from minispec.speculative.sampling import check_logits, check_sampling_args

MAX_BLOCK = 1024


@triton.jit
def _ordered_key(x):
    """float32 -> int32 with the same order. -0.0 and +0.0 compare equal, so they share a key."""
    bits = x.to(tl.int32, bitcast=True)
    # Negative floats: larger magnitude must mean smaller key, so flip every bit but the sign.
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, key)


@triton.jit
def _load_logits(row_ptr, cols, V):
    """One chunk of a row of logits as float32; -inf past the end of the row."""
    return tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)


@triton.jit
def _row_max(row_ptr, V, BLOCK: tl.constexpr):
    """The largest logit in the row, and the first column that holds it."""
    best = tl.full([], float("-inf"), tl.float32)
    best_col = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = _load_logits(row_ptr, cols, V)
        chunk_best = tl.max(x, axis=0)
        chunk_col = tl.min(tl.where(x == chunk_best, cols, V), axis=0)
        # Strictly greater: on a tie between chunks the earlier column wins, as in torch.argmax.
        best_col = tl.where(chunk_best > best, chunk_col, best_col)
        best = tl.maximum(best, chunk_best)
    return best, best_col


@triton.jit
def _scaled_logits(row_ptr, cols, V, x_max, temperature):
    """z = (logits - max logit) / temperature for one chunk of columns, as the reference computes it:
    every z <= 0, the largest exactly 0, so a tiny temperature cannot overflow. -inf past the end."""
    x = _load_logits(row_ptr, cols, V)
    # Correctly rounded division, as torch does on CPU: z decides which tokens tie at the top-k
    # boundary. (A plain `/` on fp32 may compile to a faster approximate division.)
    return tl.math.div_rn(x - x_max, temperature)


@triton.jit
def _count_at_least(row_ptr, V, x_max, temperature, t, BLOCK: tl.constexpr):
    """How many tokens of the row have key(z) >= t."""
    count = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = _scaled_logits(row_ptr, cols, V, x_max, temperature)
        count += tl.sum(((cols < V) & (_ordered_key(z) >= t)).to(tl.int32), axis=0)
    return count


@triton.jit
def _kth_largest_key(row_ptr, V, x_max, temperature, k, BLOCK: tl.constexpr):
    """key of the k-th largest z: the largest t with count(key >= t) >= k."""
    # Invariant: count(>= lo) >= k (every key is >= INT32_MIN) and count(>= hi) < k (nothing is
    # above the largest z, 0, whose key is 0). int64, because hi - lo can exceed the int32 range.
    lo = tl.full([], -2**31, tl.int64)
    hi = tl.full([], 1, tl.int64)
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if _count_at_least(row_ptr, V, x_max, temperature, mid, BLOCK) >= k:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _numerators(row_ptr, cols, V, x_max, temperature, k_key):
    """exp(z) in float64 for the top-k survivors in one chunk, 0 for the rest: softmax before dividing
    (z's largest value is already 0)."""
    z = _scaled_logits(row_ptr, cols, V, x_max, temperature)
    return tl.where(_ordered_key(z) >= k_key, tl.exp(z.to(tl.float64)), 0.0)


@triton.jit
def _mass_above(p_row, V, t, BLOCK: tl.constexpr):
    """Total probability (a float64 sum) of the tokens with key(p) > t, p read from the row p_row."""
    mass = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = tl.load(p_row + cols, mask=cols < V, other=0.0)
        mass += tl.sum(tl.where(_ordered_key(p) > t, p.to(tl.float64), 0.0), axis=0)
    return mass


@triton.jit
def _top_p_key(p_row, V, top_p, BLOCK: tl.constexpr):
    """The smallest t with mass(key(p) > t) < top_p; the tokens with key(p) >= t are the nucleus."""
    # Invariant: mass(> hi) < top_p (no probability exceeds 1.0) and mass(> lo) >= top_p, which
    # holds for the true probabilities at lo = -1 (the whole row) and is never evaluated anyway.
    lo = tl.full([], -1, tl.int32)
    hi = _ordered_key(tl.full([], 1.0, tl.float32))
    while hi - lo > 1:
        mid = lo + (hi - lo) // 2
        if _mass_above(p_row, V, mid, BLOCK) < top_p:
            hi = mid
        else:
            lo = mid
    return hi


@triton.jit
def _sampling_probs_kernel(logits_ptr, out_ptr, V, temperature, top_k, top_p_ptr,
                           USE_TOP_K: tl.constexpr, USE_TOP_P: tl.constexpr, BLOCK: tl.constexpr):
    # int64: row * V passes 2**31 for a large batch over a large vocabulary.
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * V
    out_row = out_ptr + row * V

    x_max, _ = _row_max(row_ptr, V, BLOCK)

    # Top-k. Every key is >= INT32_MIN, so without top-k that threshold keeps every token.
    k_key = tl.full([], -2**31, tl.int64)
    if USE_TOP_K:
        k_key = _kth_largest_key(row_ptr, V, x_max, temperature, top_k, BLOCK)

    # Softmax denominator over the survivors. The largest z, 0, always survives, so the sum is >= 1.
    denom = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        denom += tl.sum(_numerators(row_ptr, cols, V, x_max, temperature, k_key), axis=0)

    # p, rounded once to float32.
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        p = (_numerators(row_ptr, cols, V, x_max, temperature, k_key) / denom).to(tl.float32)
        tl.store(out_row + cols, p, mask=cols < V)

    # Top-p over the stored p, then renormalise over the nucleus.
    if USE_TOP_P:
        tl.debug_barrier()  # the passes below read p that other threads of this program stored
        top_p = tl.load(top_p_ptr)
        p_key = _top_p_key(out_row, V, top_p, BLOCK)
        kept_mass = _mass_above(out_row, V, p_key - 1, BLOCK)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            p = tl.load(out_row + cols, mask=cols < V, other=0.0)
            p = tl.where(_ordered_key(p) >= p_key, (p.to(tl.float64) / kept_mass).to(tl.float32), 0.0)
            tl.store(out_row + cols, p, mask=cols < V)


@triton.jit
def _one_hot_argmax_kernel(logits_ptr, out_ptr, V, BLOCK: tl.constexpr):
    """Temperature 0: all the mass on the first argmax of the row."""
    row = tl.program_id(0).to(tl.int64)
    _, argmax = _row_max(logits_ptr + row * V, V, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * V + cols, (cols == argmax).to(tl.float32), mask=cols < V)


def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """Same contract as the reference: logits [..., V] -> float32 probabilities [..., V]."""
    check_sampling_args(temperature, top_k, top_p)
    check_logits(logits)
    V = logits.shape[-1]
    rows = logits.reshape(-1, V).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    grid = (rows.shape[0],)
    block = min(MAX_BLOCK, triton.next_power_of_2(V))
    if temperature == 0:
        _one_hot_argmax_kernel[grid](rows, out, V, BLOCK=block)
    else:
        _sampling_probs_kernel[grid](
            rows, out, V, float(temperature), min(top_k or V, V),
            torch.tensor([float(top_p or 1.0)], dtype=torch.float64, device=logits.device),
            USE_TOP_K=top_k is not None and top_k < V, USE_TOP_P=top_p is not None and top_p < 1,
            BLOCK=block,
        )
    return out.reshape(logits.shape)
