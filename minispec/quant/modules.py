"""Quantized linear layers: fake quantization for calibration, sensitivity and QAD; packed layers for serving.

Formats (what a recipe maps a module name to; the formats of Model Optimizer's Nemotron recipes):

    "w4a16"  NVFP4 weights (E2M1 codes, E4M3 scale per 16, FP32 per tensor), 16-bit activations   4.5 bits
    "w4a4"   NVFP4 weights and NVFP4 activations (dynamic block scales, calibrated per-tensor amax) 4.5 bits
    "fp8"    FP8 E4M3 weights and activations, one FP32 scale per tensor each (W8A8)               8 bits
    "bf16"   the exception: the module is left as it is, stored in BF16                            16 bits

Fake quantization computes x̂ = dequantize(quantize(x)) in float32 and returns x + (x̂ − x).detach():
the forward sees x̂, the backward passes the gradient straight through (the straight-through estimator,
Model Optimizer's default `pass_through_bwd=True`), so QAD can train the full-precision weights.

NVFP4 weight scales come in two kinds (as in Model Optimizer's quantizers):
    static   block scales fixed at calibration (max, MSE or four-over-six) and kept in a buffer; weights
             that grow past 6 · s_b · g during QAD saturate. Needed by MSE and four-over-six, whose
             per-block choice is a calibration result.
    dynamic  block scales recomputed from the current weight at every forward; only the per-tensor
             global scale stays as calibrated (Model Optimizer's NVFP4 `type: dynamic`).
Scales are buffers, never parameters: QAD moves weights, not scales.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from minispec.quant import nvfp4
from minispec.quant.gemm import w4a16_matmul

FORMATS = {"w4a16": 4.5, "w4a4": 4.5, "fp8": 8.0, "bf16": 16.0}  # format -> effective bits per weight
NVFP4_FORMATS = ("w4a16", "w4a4")
QUANTIZED_INPUT = ("w4a4", "fp8")
SCALE_KINDS = ("static", "dynamic")


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}: expected one of {sorted(FORMATS)}")
    return fmt


def ste(x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """Forward x̂, backward identity: the straight-through estimator."""
    return x + (x_hat.to(x.dtype) - x).detach()


def check_finite(x: torch.Tensor, what: str) -> None:
    bad = (~torch.isfinite(x)).sum().item()
    if bad:
        raise ValueError(f"cannot quantize {what}: it has {bad} NaN or ±inf entries")


# --- the value transforms (float32 in, float32 out, no gradient rule) -------------------------------

def nvfp4_fake(x: torch.Tensor, global_scale: torch.Tensor, block_scales: torch.Tensor | None = None,
               four_over_six: bool = False) -> torch.Tensor:
    """NVFP4 quantize-dequantize of x [..., K] (K a multiple of 16) with the decode scale g.

    block_scales [..., K // 16] (E4M3 values as float32) are used if given (static scales); otherwise they
    are computed from x now (dynamic): max → 6, or the four-over-six choice.
    """
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE)
    if block_scales is None:
        if four_over_six:
            block_scales = nvfp4.four_over_six_block_scales(blocks, global_scale)
        else:
            block_scales = nvfp4.block_scales(blocks.abs().amax(dim=-1), global_scale)
    values = nvfp4.quantize_blocks(blocks, block_scales, global_scale)
    return nvfp4.dequantize_blocks(values, block_scales, global_scale).reshape(x.shape)


def e4m3_signed(x: torch.Tensor) -> torch.Tensor:
    """Round float32 x to the nearest E4M3 value, ties to even, saturating at ±448."""
    return torch.copysign(nvfp4.e4m3_round(x.abs()), x)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-tensor FP8 scale amax / 448 (floored like NVFP4's g so that an all-zero tensor works)."""
    return (amax.float() / nvfp4.E4M3_MAX).clamp(min=nvfp4.FP32_MIN_NORMAL)


def fp8_fake(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 quantize-dequantize with one per-tensor scale: E4M3(x / s) · s."""
    return e4m3_signed(x.float() / scale) * scale


# --- calibration of NVFP4 weight block scales -------------------------------------------------------

# Model Optimizer searches 0.25 .. 4.0 in steps of 0.1 (which misses 1.0 itself). Block scales above the max
# only saturate or waste range, and far below it clip most of the block, so minispec searches 0.5 .. 1.5 in
# steps of 0.05: 1.0 included (MSE is then never worse than max), half the candidates, half the time.
MSE_MULTIPLIERS = tuple(round(0.5 + 0.05 * i, 2) for i in range(21))


def mse_block_scales(weight: torch.Tensor, global_scale: torch.Tensor,
                     multipliers=MSE_MULTIPLIERS) -> torch.Tensor:
    """Per block, the E4M3 scale of c · a_b / (6 · g) with the c that minimizes the block's squared error.

    weight [N, K]. Returns float32 [N, K // 16]. Candidates are tried in order; the first of equal errors
    wins, so c = 1 (plain max) is kept unless another multiplier is strictly better (as Model Optimizer's
    `MseCalibrator` keeps the first argmin).
    """
    blocks = weight.float().reshape(weight.shape[0], -1, nvfp4.BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)
    order = sorted(multipliers, key=lambda c: (c != 1.0, c))  # c = 1 first: it wins ties
    best_scale = best_error = None
    for c in order:
        scale = nvfp4.block_scales(amax * c, global_scale)
        error = nvfp4.block_squared_error(blocks, scale, global_scale)
        if best_scale is None:
            best_scale, best_error = scale, error
        else:
            better = error < best_error
            best_scale = torch.where(better, scale, best_scale)
            best_error = torch.where(better, error, best_error)
    return best_scale


# --- the layers -------------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A fake-quantized nn.Linear. It shares the original's weight and bias Parameters (a tied output
    head stays tied to its embedding), and adds its quantizer state as buffers:

        weight_global_scale  g (NVFP4: amax / (6 · 448), or / (6 · 256) with four-over-six; FP8: amax / 448)
        weight_block_scale   [N, K // 16] E4M3 block scales (NVFP4 static scales only)
        input_amax           calibrated max |x| of the input (w4a4, fp8); 0 until calibrated
    """

    def __init__(self, linear: nn.Linear, fmt: str, scales: str = "static"):
        super().__init__()
        if check_format(fmt) == "bf16":
            raise ValueError("bf16 is the exception format: leave the module unquantized instead")
        if scales not in SCALE_KINDS:
            raise ValueError(f"scales must be one of {SCALE_KINDS}, got {scales!r}")
        if fmt in NVFP4_FORMATS and linear.in_features % nvfp4.BLOCK_SIZE:
            raise ValueError(f"NVFP4 needs in_features to be a multiple of {nvfp4.BLOCK_SIZE} (blocks run along "
                             f"K); this layer has in_features={linear.in_features}. minispec does not pad: keep it "
                             "in fp8 or bf16")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.format = fmt
        self.scales = scales
        self.four_over_six = False
        self.calibrating = False
        self.register_buffer("weight_global_scale", torch.ones((), device=linear.weight.device))
        self.register_buffer("weight_block_scale", torch.empty(0, device=linear.weight.device))
        self.register_buffer("input_amax", torch.zeros((), device=linear.weight.device))
        self._cache = None  # (weight version, data pointer, x̂) for no-grad inference

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"scales={self.scales}{', four_over_six' if self.four_over_six else ''}")

    # --- calibration ---

    def calibrate_weight(self, method: str = "max") -> None:
        """Set the weight scales from the weight: "max", "mse" (NVFP4 multiplier search) or "four_over_six"."""
        w = self.weight.detach().float()
        check_finite(w, "the weight")
        self._cache = None  # new scales: a cached Ŵ is stale
        amax = w.abs().amax()
        if self.format == "fp8":
            self.weight_global_scale = fp8_scale(amax)
            return
        self.four_over_six = method == "four_over_six"
        g = nvfp4.global_scale_from_amax(amax, self.four_over_six).to(w.device)
        self.weight_global_scale = g
        blocks = w.reshape(w.shape[0], -1, nvfp4.BLOCK_SIZE)
        if self.scales == "dynamic":
            if method == "mse":
                raise ValueError("mse calibration chooses static block scales; use scales='static'")
            self.weight_block_scale = torch.empty(0, device=w.device)
        elif method == "max":
            self.weight_block_scale = nvfp4.block_scales(blocks.abs().amax(dim=-1), g)
        elif method == "mse":
            self.weight_block_scale = mse_block_scales(w, g)
        elif method == "four_over_six":
            self.weight_block_scale = nvfp4.four_over_six_block_scales(blocks, g)
        else:
            raise ValueError(f"unknown calibration method {method!r}: expected max, mse or four_over_six")

    # --- forward ---

    def quantized_weight(self) -> torch.Tensor:
        """Ŵ with the straight-through estimator (cached while no gradient is needed)."""
        w = self.weight
        key = (w._version, w.data_ptr())
        if not torch.is_grad_enabled() and self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        if self.format == "fp8":
            w_hat = fp8_fake(w.detach(), fp8_scale(w.detach().abs().amax()) if self.scales == "dynamic"
                             else self.weight_global_scale)
        else:
            static = self.weight_block_scale if self.scales == "static" else None
            if static is not None and static.numel() == 0:
                raise RuntimeError("QuantLinear used before calibration: run minispec.quant.quantize")
            w_hat = nvfp4_fake(w.detach(), self.weight_global_scale, static, self.four_over_six)
        out = ste(w, w_hat)
        if not torch.is_grad_enabled():
            self._cache = (key, out)
        return out

    def quantized_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.format not in QUANTIZED_INPUT:
            return x
        if self.calibrating:
            self.input_amax = torch.maximum(self.input_amax, x.detach().abs().amax().float())
            return x
        if not self.input_amax > 0:
            raise RuntimeError(f"{self.format} quantizes activations: calibrate input_amax with a forward_loop first")
        if self.format == "fp8":
            return ste(x, fp8_fake(x.detach(), fp8_scale(self.input_amax)))
        g = nvfp4.global_scale_from_amax(self.input_amax)
        return ste(x, nvfp4_fake(x.detach(), g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantized_input(x), self.quantized_weight().to(x.dtype), self.bias)

    # --- real storage ---

    def packed_weight(self) -> dict[str, torch.Tensor]:
        """The stored form of the weight under the calibrated scales (Model Optimizer's export names):
        NVFP4: weight uint8 [N, K // 2], weight_scale float8_e4m3fn [N, K // 16], weight_scale_2 float32;
        FP8: weight float8_e4m3fn [N, K], weight_scale float32. Plus input_scale when activations are quantized."""
        w = self.weight.detach().float()
        check_finite(w, "the weight")
        if self.format == "fp8":
            s = fp8_scale(w.abs().amax()) if self.scales == "dynamic" else self.weight_global_scale
            out = {"weight": e4m3_signed(w / s).to(torch.float8_e4m3fn), "weight_scale": s.float().reshape(())}
        else:
            g = self.weight_global_scale.float()
            blocks = w.reshape(w.shape[0], -1, nvfp4.BLOCK_SIZE)
            if self.scales == "static":
                scales = self.weight_block_scale
            elif self.four_over_six:
                scales = nvfp4.four_over_six_block_scales(blocks, g)
            else:
                scales = nvfp4.block_scales(blocks.abs().amax(dim=-1), g)
            codes = nvfp4.e2m1_encode(nvfp4.quantize_blocks(blocks, scales, g)).reshape(w.shape)
            out = {"weight": nvfp4.pack_nibbles(codes), "weight_scale": scales.to(torch.float8_e4m3fn),
                   "weight_scale_2": g.reshape(())}
        if self.format in QUANTIZED_INPUT:
            amax = self.input_amax.float()
            out["input_scale"] = (fp8_scale(amax) if self.format == "fp8"
                                  else nvfp4.global_scale_from_amax(amax)).reshape(())
        if self.bias is not None:
            out["bias"] = self.bias.detach().to(torch.bfloat16)
        return out


class PackedLinear(nn.Module):
    """A linear layer that serves from packed storage (what an exported checkpoint loads into).

    w4a16: y = w4a16_matmul(x, W) — the NVFP4 weight stays packed and is dequantized inside the GEMM
    (Triton kernel kernels/gemm.py where the backend picks it). w4a4 additionally quantizes x to NVFP4
    with the stored input scale first (emulated: real W4A4 needs FP4 tensor cores). fp8: E4M3 weight times
    its scale, activations through E4M3.
    """

    def __init__(self, fmt: str, tensors: dict[str, torch.Tensor], in_features: int, out_features: int):
        super().__init__()
        self.format = check_format(fmt)
        self.in_features, self.out_features = in_features, out_features
        for name, t in tensors.items():
            self.register_buffer(name, t)
        if "bias" not in tensors:
            self.bias = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format} (packed)"

    def nvfp4_weight(self) -> nvfp4.NVFP4Tensor:
        return nvfp4.NVFP4Tensor(self.weight, self.weight_scale, self.weight_scale_2.float().reshape(()),
                                 (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format == "fp8":
            w = self.weight.float() * self.weight_scale.float()
            x = ste(x, fp8_fake(x.detach(), self.input_scale.float()))
            y = F.linear(x.float(), w).to(x.dtype)
        else:
            if self.format == "w4a4":
                x = ste(x, nvfp4_fake(x.detach(), self.input_scale.float()))
            lead = x.shape[:-1]
            y = w4a16_matmul(x.reshape(-1, self.in_features).contiguous(), self.nvfp4_weight())
            y = y.reshape(*lead, self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
