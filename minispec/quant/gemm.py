"""W4A16: a matmul of 16-bit (or 32-bit) activations with NVFP4 weights.

    y = x @ dequantize(w).T        x [..., K] bf16/fp16/fp32,  w: NVFP4Tensor [N, K],  y [..., N] in x's dtype

This is how an NVFP4 checkpoint runs on GPUs without FP4 tensor cores (Hopper and older): the weights
stay packed in memory (4.5 bits each) and are dequantized on the fly, next to the multiply. In
decoding (few rows of x) a linear layer is bound by reading its weights, so reading ~3.5× fewer bytes
than bf16 is the whole speed-up.

The reference dequantizes in float32 and multiplies in float32, rounding to x's dtype once at the end.
The Triton kernel (kernels/gemm.py) does the same sum in a different order and with the per-tensor
scale applied once at the end; the tests hold it to a stated tolerance (tests/test_gemm.py).
"""
from __future__ import annotations

import torch

from minispec.backend import dispatch
from minispec.quant.nvfp4 import NVFP4Tensor, dequantize

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_w4a16_args(x: torch.Tensor, w: NVFP4Tensor) -> None:
    """Raise ValueError unless x [..., K] (bf16/fp16/fp32) and the NVFP4 weight w [N, K] fit together."""
    if not isinstance(w, NVFP4Tensor):
        raise TypeError(f"w4a16_matmul needs the weight as an NVFP4Tensor (see quantize), got {type(w).__name__}")
    if len(w.shape) != 2:
        raise ValueError(f"w4a16_matmul needs a 2-D weight [N, K], got shape {tuple(w.shape)}")
    if not isinstance(x, torch.Tensor) or x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"w4a16_matmul needs x as a bfloat16, float16 or float32 tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x's last dimension must equal the weight's K: x {tuple(x.shape)}, w {tuple(w.shape)}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but the weight is on {w.device}")


@dispatch("gemm:w4a16_matmul")
def w4a16_matmul(x: torch.Tensor, w: NVFP4Tensor) -> torch.Tensor:
    """x [..., K] @ dequantize(w [N, K]).T -> [..., N] in x's dtype (float32 math, one rounding at the end)."""
    check_w4a16_args(x, w)
    w_hat = dequantize.reference(w.codes, w.block_scales, w.global_scale, torch.float32)  # [N, K]
    return (x.float() @ w_hat.T).to(x.dtype)
