"""W4A16 and W4A4: matmuls with NVFP4 weights, of 16-bit (or 32-bit) activations or of NVFP4 activations.

    W4A16  y = x @ dequantize(w).T                      x [..., K] bf16/fp16/fp32, w: NVFP4Tensor [N, K]
    W4A4   y = fake_quantize(x, g_x) @ dequantize(w).T  the same, x first quantized to NVFP4 per block of 16
    y [..., N] in x's dtype.

This is how an NVFP4 checkpoint runs on GPUs without FP4 tensor cores (Hopper and older): the weights
stay packed in memory (4.5 bits each) and are dequantized on the fly, next to the multiply. In
decoding (few rows of x) a linear layer is bound by reading its weights, so reading ~3.5× fewer bytes
than bf16 is the whole speed-up.

The reference dequantizes in float32 and multiplies in float32, rounding to x's dtype once at the end.
The Triton kernel (kernels/gemm.py) does the same sum in a different order and with the per-tensor
scale applied once at the end; the tests hold it to a stated tolerance (tests/test_gemm.py).

W4A4 is what Blackwell's FP4 tensor cores run: both operands in NVFP4, so the multiply itself reads
4-bit codes. The activations are quantized on the fly, as a W4A4 layer does at serving time: block
scales from each block of 16 of x (dynamic), the per-tensor decode scale g_x = input_scale fixed at
calibration (amax / (6 · 448), Model Optimizer's `input_scale`). The reference is the emulation:
quantize-dequantize x in float32, then the W4A16 reference on x̂. Its kernel (kernels/gemm.py) takes
the same codes and block scales for x, bit for bit, and multiplies q_x · s_x by q_w · s_w (exact
products) with g_x · g_w applied once at the end (tests/test_w4a4.py).
"""
from __future__ import annotations

import torch

from minispec.backend import dispatch
from minispec.quant.nvfp4 import NVFP4Tensor, dequantize, quantize

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


def check_w4a4_args(x: torch.Tensor, w: NVFP4Tensor, input_scale: torch.Tensor) -> None:
    """`check_w4a16_args`, plus: input_scale a float32 one-element tensor on x's device."""
    check_w4a16_args(x, w)
    if not isinstance(input_scale, torch.Tensor):
        raise ValueError(f"w4a4_matmul needs input_scale (g_x, the activations' decode scale) as a tensor, "
                         f"got {type(input_scale).__name__}")
    if input_scale.dtype != torch.float32 or input_scale.numel() != 1:
        raise ValueError(f"w4a4_matmul needs input_scale (g_x, the activations' decode scale) as a float32 tensor "
                         f"of one element, got {input_scale.dtype} {tuple(input_scale.shape)}")
    if input_scale.device != x.device:
        raise ValueError(f"x is on {x.device} but input_scale is on {input_scale.device}")


@dispatch("gemm:w4a4_matmul")
def w4a4_matmul(x: torch.Tensor, w: NVFP4Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4(x; g_x = input_scale) [..., K] @ dequantize(w [N, K]).T -> [..., N] in x's dtype.

    x is quantized with dynamic block scales and the calibrated global scale (blocks whose scale would
    pass 448 saturate, as in `quantize`), dequantized in float32 and multiplied in float32, rounded
    to x's dtype once at the end.
    """
    check_w4a4_args(x, w, input_scale)
    x_q = quantize.reference(x, global_scale=input_scale)
    x_hat = dequantize.reference(x_q.codes, x_q.block_scales, x_q.global_scale, torch.float32)
    return w4a16_matmul.reference(x_hat, w).to(x.dtype)
