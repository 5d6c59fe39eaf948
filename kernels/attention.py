"""DFlash's block attention in one Triton kernel: T block queries over cached context + the block.

Kernel of the reference `minispec.dflash.attention.dflash_attention`, with the same signature, the same
argument checks (`check_attention_args`) and the same semantics:

    q [B, T, Hq, D] over keys [k_ctx[b, :ctx_lens[b]] ; k_blk[b]]   (non-causal, GQA, sliding window)

One program owns one (sequence b, kv head g). Its rows are the T queries of each of the Hq/Hkv query
heads that read kv head g, so a context tile is loaded once and serves the whole group (for a block of
8 and 4 heads per group that is 32 rows, a natural tensor-core tile). The program streams the context
in BLOCK_N-wide tiles with an online softmax (running max m, running sum l, rescaled accumulator),
then folds in the block's own T keys as one last tile. Only the context that can be visible is read:
with a window W, tiles start at slot ctx_len - W + 1.

Visibility, for row (head h, block position t) and context slot i of row b:
    i < ctx_len[b]                    a real slot (rows are left-aligned, the newest slot last)
    (ctx_len[b] - i) + t < W          inside the window, if any: the slot is ctx_len - i positions
                                      before the anchor, and query t sits t positions after it
Block keys are always visible (the wrapper requires W >= T).

Numerics: scores, softmax statistics and the accumulator are float32. float32 inputs use IEEE
products (no TF32), so the kernel matches the reference to ~1e-6; 16-bit inputs multiply in their own
precision with float32 accumulation; float64 tiles multiply in float64 and their products are cast to
float32 (a GPU compile refuses a loop whose running max changes type; the interpreter does not).

Interpreter gap (triton 3.9): under TRITON_INTERPRET=1, `tl.dot` on bfloat16 operands returns garbage
(off by ~1e10 on a 16x16 product; float16 and float32 are fine). So when this module was imported for
the interpreter, bfloat16 tiles are widened to float32 right after loading (UPCAST). Compiled for a
GPU, bfloat16 goes to the tensor cores as it is.
"""
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from minispec.dflash.attention import check_attention_args


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores s [M, N] (-inf where hidden) and values v [N, D] into the running state."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen nothing yet keeps m = -inf; shift by 0 there so exp() gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION).to(tl.float32)
    return acc, m_new, l_i


@triton.jit
def _dflash_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, lens_ptr, out_ptr,
    sq_b, sq_t, sq_h, sq_d,
    skc_b, skc_n, skc_h, skc_d,
    svc_b, svc_n, svc_h, svc_d,
    skb_b, skb_t, skb_h, skb_d,
    svb_b, svb_t, svb_h, svb_d,
    so_b, so_t, so_h, so_d,
    T, D, window, scale,
    GROUP: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)

    rows = tl.arange(0, BLOCK_M)
    t = rows % T  # block position of the row
    h = g * GROUP + rows // T  # its query head
    row_ok = rows < GROUP * T
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + h[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    ctx_len = tl.load(lens_ptr + b).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Context tiles. With a window, slots before ctx_len - window + 1 are hidden from every row.
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(ctx_len - window + 1, 0)
    for n0 in range(start, ctx_len, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < ctx_len
        kv_mask = col_ok[:, None] & d_ok[None, :]
        k = tl.load(kc_ptr + b * skc_b + cols[:, None] * skc_n + g * skc_h + d[None, :] * skc_d,
                    mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
        visible = row_ok[:, None] & col_ok[None, :]
        if HAS_WINDOW:
            visible = visible & ((ctx_len - cols)[None, :] + t[:, None] < window)
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(vc_ptr + b * svc_b + cols[:, None] * svc_n + g * svc_h + d[None, :] * svc_d,
                    mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    # The block's own keys: all T of them, for every row (bidirectional inside the block).
    cols = tl.arange(0, BLOCK_T)
    col_ok = cols < T
    kv_mask = col_ok[:, None] & d_ok[None, :]
    k = tl.load(kb_ptr + b * skb_b + cols[:, None] * skb_t + g * skb_h + d[None, :] * skb_d, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
    s = tl.where(row_ok[:, None] & col_ok[None, :], s, float("-inf"))
    v = tl.load(vb_ptr + b * svb_b + cols[:, None] * svb_t + g * svb_h + d[None, :] * svb_d, mask=kv_mask, other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION)

    # Every real row has seen its own block, so l > 0; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * so_b + t[:, None] * so_t + h[:, None] * so_h + d[None, :] * so_d,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Under the interpreter `@triton.jit` makes an InterpretedFunction, which is not a JITFunction.
INTERPRETED = not isinstance(_dflash_attention_kernel, JITFunction)


def _tile(n: int) -> int:
    """Power of two >= n and >= 16 (the smallest tl.dot operand on GPUs)."""
    return max(16, triton.next_power_of_2(n))


def _context_tile(dtype: torch.dtype) -> int:
    """Context keys per tile. 32, but 16 for float64: its K and V tiles of 32 x 128 take twice the bytes,
    and Triton 3.8 keeps enough of them in shared memory (software pipelining) that a 32-key tile needs
    172,032 bytes on sm_80, over the A100's 166,912 (docs/kernels.md lists every config's need)."""
    return 16 if dtype == torch.float64 else 32


def dflash_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_blk: torch.Tensor,
                     v_blk: torch.Tensor, ctx_lens: torch.Tensor, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Same contract as the reference: -> [B, T, Hq, D] in q's dtype."""
    check_attention_args(q, k_ctx, v_ctx, k_blk, v_blk, ctx_lens, window)
    dtypes = {q.dtype, k_ctx.dtype, v_ctx.dtype, k_blk.dtype, v_blk.dtype}
    if len(dtypes) != 1 or q.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(f"q, k and v must share one float dtype (float32, float16, bfloat16 or float64), "
                         f"got {sorted(str(x) for x in dtypes)}")
    B, T, Hq, D = q.shape
    Hkv = k_ctx.shape[2]
    out = torch.empty_like(q)
    if B == 0:
        return out
    if k_ctx.shape[1] == 0:  # no cached context yet: hand the kernel one slot it will never read
        k_ctx = v_ctx = q.new_zeros(B, 1, Hkv, D)
    ctx_lens = ctx_lens.to(device=q.device, dtype=torch.int32).contiguous()
    group = Hq // Hkv
    upcast = INTERPRETED and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    precision = "ieee" if upcast or q.dtype in (torch.float32, torch.float64) else "tf32"
    _dflash_attention_kernel[(B, Hkv)](
        q, k_ctx, v_ctx, k_blk, v_blk, ctx_lens, out,
        *q.stride(), *k_ctx.stride(), *v_ctx.stride(), *k_blk.stride(), *v_blk.stride(), *out.stride(),
        T, D, 0 if window is None else int(window), float(D ** -0.5 if scale is None else scale),
        GROUP=group, HAS_WINDOW=window is not None, DOT_PRECISION=precision, UPCAST=upcast,
        BLOCK_M=_tile(group * T), BLOCK_N=_context_tile(q.dtype), BLOCK_T=_tile(T), BLOCK_D=_tile(D),
    )
    return out
