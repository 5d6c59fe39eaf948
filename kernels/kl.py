"""Forward KL(teacher ‖ student) over a large vocabulary, streamed in chunks: forward and backward.

Kernel for `minispec.kl.kl_divergence`, with the same signature and semantics. Logits [..., V] are
flattened to rows [N, V]; one program owns one row and walks its vocabulary in BLOCK_V-wide chunks.

Forward. With t = teacher / T and s = student / T (float32 in registers, whatever the input dtype),

    KL = Σ_v p_t (t − s) − lse(t) + lse(s),     p_t = exp(t − lse(t))

needs three running sums, each kept with an online log-sum-exp (running max m, rescaled on a new max):
    z_t = Σ exp(t − m_t),  z_s = Σ exp(s − m_s),  a = Σ exp(t − m_t) · (t − s)
so KL = a / z_t − (m_t + log z_t) + (m_s + log z_s). The row's KL and its two log-sum-exps are stored:
12 bytes per row are all the float32 state the backward needs.

Backward. ∂KL/∂s_v = (p_s(v) − p_t(v)) / T, times the upstream gradient of the row (1/N of the mean's for
reduction="mean"). A second pass re-reads both rows chunk by chunk, rebuilds p_s and p_t from the stored
log-sum-exps, and writes the gradient straight into the student's dtype. So at V = 262,144 nothing
V-sized in float32 exists at any point, per token or in total; the only V-sized tensor made is the
gradient itself, in the student's dtype, which autograd needs anyway.

NaN / ±inf are counted per row during the forward pass (no separate torch.isfinite pass, which would
allocate [N, V] booleans), and raise the reference's ValueError afterwards.

Rounding to bfloat16 (BF16_OUT): the gradient is rounded to nearest-even by integer arithmetic on the
float32 bits before the store. Triton 3.9's interpreter truncates on a float32 -> bfloat16 cast, a GPU
rounds to nearest; on an already-rounded value both give the same bits, so interpreter and GPU agree
with PyTorch's rounding.
"""
import torch
import triton
import triton.language as tl

from minispec.kl import check_kl_args, non_finite_error, reduce_rows

MAX_BLOCK_V = 4096


@triton.jit
def _kl_forward_kernel(t_ptr, s_ptr, kl_ptr, lse_ptr, bad_ptr, V, stride_t, stride_s, inv_temp,
                       BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t_row = t_ptr + row * stride_t
    s_row = s_ptr + row * stride_s
    m_t = float("-inf")
    m_s = float("-inf")
    z_t = 0.0
    z_s = 0.0
    a = 0.0
    bad_t = 0
    bad_s = 0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        t = tl.load(t_row + cols, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(s_row + cols, mask=ok, other=0.0).to(tl.float32)
        bad_t += tl.sum(((t != t) | (tl.abs(t) == float("inf"))).to(tl.int32), axis=0)
        bad_s += tl.sum(((s != s) | (tl.abs(s) == float("inf"))).to(tl.int32), axis=0)
        t = t * inv_temp
        s = s * inv_temp
        # Every chunk has at least one real column (v0 < V), so the new maxima are finite for finite input.
        m_t_new = tl.maximum(m_t, tl.max(tl.where(ok, t, float("-inf")), axis=0))
        m_s_new = tl.maximum(m_s, tl.max(tl.where(ok, s, float("-inf")), axis=0))
        e_t = tl.exp(tl.where(ok, t - m_t_new, float("-inf")))
        e_s = tl.exp(tl.where(ok, s - m_s_new, float("-inf")))
        alpha_t = tl.exp(m_t - m_t_new)
        z_t = z_t * alpha_t + tl.sum(e_t, axis=0)
        a = a * alpha_t + tl.sum(e_t * (t - s), axis=0)
        z_s = z_s * tl.exp(m_s - m_s_new) + tl.sum(e_s, axis=0)
        m_t = m_t_new
        m_s = m_s_new
    lse_t = m_t + tl.log(z_t)
    lse_s = m_s + tl.log(z_s)
    tl.store(kl_ptr + row, a / z_t - lse_t + lse_s)
    tl.store(lse_ptr + 2 * row, lse_t)
    tl.store(lse_ptr + 2 * row + 1, lse_s)
    tl.store(bad_ptr + 2 * row, bad_t)
    tl.store(bad_ptr + 2 * row + 1, bad_s)


@triton.jit
def _kl_backward_kernel(t_ptr, s_ptr, lse_ptr, g_ptr, grad_ptr, V, stride_t, stride_s, stride_grad, inv_temp,
                        BLOCK_V: tl.constexpr, BF16_OUT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lse_t = tl.load(lse_ptr + 2 * row)
    lse_s = tl.load(lse_ptr + 2 * row + 1)
    scale = tl.load(g_ptr + row) * inv_temp
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        t = tl.load(t_ptr + row * stride_t + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        s = tl.load(s_ptr + row * stride_s + cols, mask=ok, other=0.0).to(tl.float32) * inv_temp
        grad = (tl.exp(s - lse_s) - tl.exp(t - lse_t)) * scale
        if BF16_OUT:
            bits = grad.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            grad = bits.to(tl.float32, bitcast=True)
        tl.store(grad_ptr + row * stride_grad + cols, grad.to(grad_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [N, V] with unit stride along V (a view when x is contiguous; never a float32 copy)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _block_v(V: int, block_v: int | None) -> int:
    if block_v is None:
        return min(MAX_BLOCK_V, triton.next_power_of_2(V))
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 1, got {block_v}")
    return block_v


def _num_warps(block_v: int) -> int:
    return 8 if block_v >= 2048 else 4


class _FusedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, teacher, student, temperature, reduction, block_v):
        shape = student.shape
        t, s = _rows(teacher.detach()), _rows(student.detach())
        N, V = s.shape
        kl = torch.empty(N, dtype=torch.float32, device=s.device)
        lse = torch.empty(N, 2, dtype=torch.float32, device=s.device)
        bad = torch.zeros(N, 2, dtype=torch.int32, device=s.device)
        if N:
            _kl_forward_kernel[(N,)](t, s, kl, lse, bad, V, t.stride(0), s.stride(0), 1.0 / temperature,
                                     BLOCK_V=block_v, num_warps=_num_warps(block_v))
            counts = bad.sum(dim=0).tolist()
            for name, count in zip(("teacher_logits", "student_logits"), counts):
                if count:
                    raise non_finite_error(name)
        ctx.save_for_backward(t, s, lse)
        ctx.shape, ctx.temperature, ctx.reduction, ctx.block_v = shape, temperature, reduction, block_v
        return reduce_rows(kl.reshape(shape[:-1]), reduction)

    @staticmethod
    def backward(ctx, grad_out):
        t, s, lse = ctx.saved_tensors
        N, V = s.shape
        if ctx.reduction == "mean":
            g = grad_out.float().expand(N) / N
        else:
            g = grad_out.float().reshape(N)
        g = g.contiguous()
        grad = torch.empty((N, V), dtype=s.dtype, device=s.device)
        if N:
            _kl_backward_kernel[(N,)](t, s, lse, g, grad, V, t.stride(0), s.stride(0), grad.stride(0),
                                      1.0 / ctx.temperature, BLOCK_V=ctx.block_v,
                                      BF16_OUT=s.dtype == torch.bfloat16, num_warps=_num_warps(ctx.block_v))
        return None, grad.reshape(ctx.shape), None, None, None


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0,
                  reduction: str = "mean", block_v: int | None = None) -> torch.Tensor:
    """Same contract as the reference (float32 result, gradient to the student only).

    block_v: vocabulary chunk width, a power of two (default min(4096, next power of two >= V)); a
    knob for tests and tuning, not part of the reference's signature.
    """
    check_kl_args(teacher_logits, student_logits, temperature, reduction, check_finite=False)
    return _FusedKL.apply(teacher_logits, student_logits, float(temperature), reduction,
                          _block_v(student_logits.shape[-1], block_v))
