"""Forward KL divergence between a teacher's and a student's next-token distributions.

    KL(p_t ‖ p_s) = Σ_v p_t(v) · (log p_t(v) − log p_s(v)),   p = softmax(logits / T)

computed per row of logits [..., V] (one row per token). This is the distillation loss of MTP boosting
(the MTP head learns the frozen backbone's whole distribution) and of QAD (the quantized student learns
the BF16 teacher's). The teacher is a constant: gradients reach the student logits only,

    ∂KL/∂s_v = (p_s(v) − p_t(v)) / T.

No T² factor is applied (Hinton et al. multiply by T² to keep gradient sizes comparable across
temperatures); callers that want it multiply the loss themselves.

The reference below forms two full float32 log-softmaxes, [..., V] each. At V = 262,144 that is
1 MiB per token per tensor, several copies deep once autograd keeps them for the backward. The Triton
kernel (kernels/kl.py, chosen by minispec.backend) streams the vocabulary in chunks with an online
log-sum-exp instead, and keeps only a few float32 numbers per row.
"""
from __future__ import annotations

import torch

from minispec.backend import dispatch

REDUCTIONS = ("mean", "none")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_kl_args(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float,
                  reduction: str, check_finite: bool = True) -> None:
    """ValueError naming the problem, for anything the reference and the kernel must both refuse.

    check_finite=False skips the pass over the logits that looks for NaN/inf: the kernel finds those
    itself while it streams the vocabulary (a separate torch.isfinite would allocate [..., V] bools).
    """
    if not isinstance(teacher_logits, torch.Tensor) or not isinstance(student_logits, torch.Tensor):
        raise ValueError("teacher_logits and student_logits must be tensors")
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"teacher_logits {tuple(teacher_logits.shape)} and student_logits "
                         f"{tuple(student_logits.shape)} must have the same shape [..., V]")
    if teacher_logits.dim() == 0 or teacher_logits.shape[-1] == 0:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(teacher_logits.shape)}")
    for name, x in (("teacher_logits", teacher_logits), ("student_logits", student_logits)):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, float16, bfloat16 or float64, got {x.dtype}")
    if teacher_logits.device != student_logits.device:
        raise ValueError(f"teacher_logits is on {teacher_logits.device}, student_logits on {student_logits.device}")
    if not isinstance(temperature, (int, float)) or not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "mean" and teacher_logits.numel() == 0:
        raise ValueError("reduction='mean' over zero rows is undefined")
    if check_finite:
        for name, x in (("teacher_logits", teacher_logits), ("student_logits", student_logits)):
            if not bool(torch.isfinite(x).all()):
                raise non_finite_error(name)


def non_finite_error(name: str) -> ValueError:
    return ValueError(f"{name} contains NaN or ±inf; KL needs finite logits")


def reduce_rows(kl: torch.Tensor, reduction: str) -> torch.Tensor:
    """kl [...] per row -> a 0-d mean over all rows, or kl itself."""
    return kl.mean() if reduction == "mean" else kl


@dispatch("kl:kl_divergence")
def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0,
                  reduction: str = "mean") -> torch.Tensor:
    """KL(softmax(teacher / T) ‖ softmax(student / T)) per row.

    teacher_logits, student_logits: [..., V], same shape, any float dtype (bf16 is fine: the math runs
    in float32). Returns float32: 0-d for reduction="mean" (mean over all rows), [...] for "none".
    Differentiable in student_logits only; teacher_logits is treated as a constant.
    """
    check_kl_args(teacher_logits, student_logits, temperature, reduction)
    log_p_t = torch.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    log_p_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(dim=-1)
    return reduce_rows(kl, reduction)
