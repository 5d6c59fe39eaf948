"""Quantized layers (linear layers and routed experts): fake quantization for calibration, sensitivity and QAD;
packed layers for serving.

Formats (what a recipe maps a module name to; the formats of Model Optimizer's Nemotron recipes):

    "w4a16"  NVFP4 weights (E2M1 codes, E4M3 scale per 16, FP32 per tensor), 16-bit activations   4.5 bits
    "w4a4"   NVFP4 weights and NVFP4 activations (dynamic block scales, calibrated per-tensor amax) 4.5 bits
    "fp8"    FP8 E4M3 weights and activations, one FP32 scale per tensor each (W8A8)               8 bits
    "bf16"   the exception: the module is left as it is, stored in BF16                            16 bits

Fake quantization computes x̂ = dequantize(quantize(x)) in float32 and returns x + (x̂ − x).detach():
the forward sees x̂, the backward passes the gradient straight through (the straight-through estimator,
Model Optimizer's default `pass_through_bwd=True`), so QAD can train the full-precision weights.

Weight scales come in two kinds, paired with the calibration as in "NVFP4 quantization and QAD of
Nemotron 3.5 Lightning" (the recipe refuses other pairs: `minispec.quant.api.check_recipe`):
    static   the global scale and the block scales fixed at calibration and kept in buffers; weights that
             grow past 6 · s_b · g during QAD saturate. Goes with MSE and four-over-six, whose per-block
             choice is a calibration result that QAD must not undo.
    dynamic  every scale, the per-tensor global scale included, recomputed from the current weight at
             every forward: the quantization follows the weights as QAD moves them. Goes with max
             calibration, which is exactly that computation. (Model Optimizer's NVFP4 `type: dynamic`
             keeps the global amax calibrated; torchao's QAT recomputes it, as here.)
Scales are buffers, never parameters: QAD moves weights, not scales.

A weight is a matrix [N, K] (a linear layer) or a stack of them [E, N, K] (the routed experts of an MoE
layer): every matrix gets its own scales, so an expert's global scale is its own amax, not the stack's.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from minispec.quant import nvfp4
from minispec.quant.gemm import w4a4_matmul, w4a16_matmul

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
    """NVFP4 quantize-dequantize of x [..., K] (K a multiple of 16) with the decode scale g (0-d, or
    broadcastable to [..., K // 16]: one g per matrix of a stack of experts).

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

    weight [..., N, K]; global_scale broadcastable to [..., N, K // 16]. Returns float32 [..., N, K // 16].
    Candidates are tried in order; the first of equal errors wins, so c = 1 (plain max) is kept unless
    another multiplier is strictly better (as Model Optimizer's `MseCalibrator` keeps the first argmin).
    """
    blocks = weight.float().reshape(*weight.shape[:-1], -1, nvfp4.BLOCK_SIZE)
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


# --- the scales of a weight [..., N, K]: one set per matrix ------------------------------------------

def global_scale_of(w: torch.Tensor, fmt: str, four_over_six: bool = False) -> torch.Tensor:
    """Per matrix of w [..., N, K], the per-tensor scale from its amax: NVFP4 g = amax / (6 · 448) (or
    / (6 · 256) with four-over-six), FP8 amax / 448. Returns float32 [...]."""
    amax = w.detach().float().abs().amax(dim=(-2, -1))
    return fp8_scale(amax) if fmt == "fp8" else nvfp4.global_scale_from_amax(amax, four_over_six).to(w.device)


def block_scales_of(w: torch.Tensor, g: torch.Tensor, method: str) -> torch.Tensor:
    """NVFP4 block scales [..., N, K // 16] of w [..., N, K] under per-matrix g [...], by `method`:
    "max" (max → 6), "mse" (multiplier search) or "four_over_six" (max → 6 or 4, whichever errs less)."""
    g = g[..., None, None]
    if method == "mse":
        return mse_block_scales(w, g)
    blocks = w.detach().float().reshape(*w.shape[:-1], -1, nvfp4.BLOCK_SIZE)
    if method == "four_over_six":
        return nvfp4.four_over_six_block_scales(blocks, g)
    if method == "max":
        return nvfp4.block_scales(blocks.abs().amax(dim=-1), g)
    raise ValueError(f"unknown calibration method {method!r}: expected max, mse or four_over_six")


class QuantizedWeights(nn.Module):
    """What the fake-quantized modules share: weights [..., N, K] quantized to one format, each with its
    scales as buffers `<weight>_global_scale` [...] and `<weight>_block_scale` [..., N, K // 16] (static
    NVFP4 only), calibrated by `calibrate_weight` and applied by `quantized(name)`.

    Subclasses name their weights in `weight_names` and keep each as a Parameter under that name."""

    weight_names: tuple[str, ...] = ()

    def _init_quantizer(self, fmt: str, scales: str, device) -> None:
        if check_format(fmt) == "bf16":
            raise ValueError("bf16 is the exception format: leave the module unquantized instead")
        if scales not in SCALE_KINDS:
            raise ValueError(f"scales must be one of {SCALE_KINDS}, got {scales!r}")
        self.format, self.scales, self.four_over_six = fmt, scales, False
        for name in self.weight_names:
            self.register_buffer(f"{name}_global_scale", torch.ones((), device=device))
            self.register_buffer(f"{name}_block_scale", torch.empty(0, device=device))
        self._cache = {}  # name -> ((weight version, data pointer), Ŵ) for no-grad inference

    def raw(self, name: str) -> nn.Parameter:
        """The full-precision weight `name` (the Parameter QAD trains)."""
        return self._parameters[name]

    def calibrate_weight(self, method: str = "max") -> None:
        """Set every weight's scales from the weight: "max", "mse" (NVFP4 multiplier search) or "four_over_six".

        With dynamic scales this only checks the method: the scales are computed at every forward."""
        if self.scales == "dynamic" and method == "mse":
            raise ValueError("mse calibration chooses static block scales; use scales='static'")
        if method not in ("max", "mse", "four_over_six"):
            raise ValueError(f"unknown calibration method {method!r}: expected max, mse or four_over_six")
        self.four_over_six = self.format in NVFP4_FORMATS and method == "four_over_six"
        self._cache = {}  # new scales: a cached Ŵ is stale
        for name in self.weight_names:
            w = self.raw(name).detach()
            check_finite(w, f"the weight {name}")
            g = global_scale_of(w, self.format, self.four_over_six)
            setattr(self, f"{name}_global_scale", g)
            static_nvfp4 = self.format in NVFP4_FORMATS and self.scales == "static"
            setattr(self, f"{name}_block_scale", block_scales_of(w, g, method) if static_nvfp4
                    else torch.empty(0, device=w.device))

    def weight_scales(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(g [...], block scales [..., N, K // 16] or None for FP8) of weight `name` as the forward uses
        them: the calibrated buffers (static), or computed from the current weight now (dynamic)."""
        w = self.raw(name).detach()
        if self.scales == "dynamic":
            g = global_scale_of(w, self.format, self.four_over_six)
            if self.format == "fp8":
                return g, None
            return g, block_scales_of(w, g, "four_over_six" if self.four_over_six else "max")
        g, s = getattr(self, f"{name}_global_scale"), getattr(self, f"{name}_block_scale")
        if self.format in NVFP4_FORMATS and s.numel() == 0:
            raise RuntimeError(f"{type(self).__name__} used before calibration: run minispec.quant.quantize")
        return g, (s if self.format in NVFP4_FORMATS else None)

    def quantized(self, name: str) -> torch.Tensor:
        """Ŵ of weight `name` with the straight-through estimator (cached while no gradient is needed)."""
        w = self.raw(name)
        key = (w._version, w.data_ptr())
        cached = self._cache.get(name)
        if not torch.is_grad_enabled() and cached is not None and cached[0] == key:
            return cached[1]
        g, s = self.weight_scales(name)
        if self.format == "fp8":
            w_hat = fp8_fake(w.detach(), g[..., None, None])
        else:
            w_hat = nvfp4_fake(w.detach(), g[..., None, None], s)
        out = ste(w, w_hat)
        if not torch.is_grad_enabled():
            self._cache[name] = (key, out)
        return out

    def packed(self, name: str) -> dict[str, torch.Tensor]:
        """The stored form of weight `name` [..., N, K] under the scales the forward uses (Model Optimizer's
        export names): NVFP4 weight uint8 [..., N, K // 2], weight_scale float8_e4m3fn [..., N, K // 16],
        weight_scale_2 float32 [...]; FP8 weight float8_e4m3fn [..., N, K], weight_scale float32 [...]."""
        w = self.raw(name).detach().float()
        check_finite(w, f"the weight {name}")
        g, s = self.weight_scales(name)
        if self.format == "fp8":
            return {"weight": e4m3_signed(w / g[..., None, None]).to(torch.float8_e4m3fn), "weight_scale": g.float()}
        blocks = w.reshape(*w.shape[:-1], -1, nvfp4.BLOCK_SIZE)
        codes = nvfp4.e2m1_encode(nvfp4.quantize_blocks(blocks, s, g[..., None, None])).reshape(w.shape)
        return {"weight": nvfp4.pack_nibbles(codes), "weight_scale": s.to(torch.float8_e4m3fn),
                "weight_scale_2": g.float()}


# --- the layers -------------------------------------------------------------------------------------

class QuantLinear(QuantizedWeights):
    """A fake-quantized nn.Linear. It shares the original's weight and bias Parameters (a tied output
    head stays tied to its embedding), and adds its quantizer state as buffers:

        weight_global_scale  g (NVFP4: amax / (6 · 448), or / (6 · 256) with four-over-six; FP8: amax / 448)
        weight_block_scale   [N, K // 16] E4M3 block scales (NVFP4 static scales only)
        input_amax           calibrated max |x| of the input (w4a4, fp8); 0 until calibrated
    """

    weight_names = ("weight",)

    def __init__(self, linear: nn.Linear, fmt: str, scales: str = "static"):
        super().__init__()
        if fmt in NVFP4_FORMATS and linear.in_features % nvfp4.BLOCK_SIZE:
            raise ValueError(f"NVFP4 needs in_features to be a multiple of {nvfp4.BLOCK_SIZE} (blocks run along "
                             f"K); this layer has in_features={linear.in_features}. minispec does not pad: keep it "
                             "in fp8 or bf16")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._init_quantizer(fmt, scales, linear.weight.device)
        self.calibrating = False
        self.register_buffer("input_amax", torch.zeros((), device=linear.weight.device))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"scales={self.scales}{', four_over_six' if self.four_over_six else ''}")

    # --- forward ---

    def quantized_weight(self) -> torch.Tensor:
        """Ŵ [N, K] with the straight-through estimator."""
        return self.quantized("weight")

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
        """The stored form of the layer (Model Optimizer's export names): `packed("weight")`, plus
        input_scale when activations are quantized, and the bias in BF16."""
        out = self.packed("weight")
        if self.format in QUANTIZED_INPUT:
            amax = self.input_amax.float()
            out["input_scale"] = (fp8_scale(amax) if self.format == "fp8"
                                  else nvfp4.global_scale_from_amax(amax)).reshape(())
        if self.bias is not None:
            out["bias"] = self.bias.detach().to(torch.bfloat16)
        return out


EXPERT_WEIGHTS = ("up_proj", "down_proj")


def is_stacked_experts(module: nn.Module) -> bool:
    """Routed experts stored as stacked matrices: 3-D Parameters up_proj [E, I, H] and down_proj [E, H, I]
    (minispec's lightning-mini and transformers' NemotronHExperts alike)."""
    params = dict(module.named_parameters(recurse=False))
    return set(params) == set(EXPERT_WEIGHTS) and all(p.dim() == 3 for p in params.values())


class QuantExperts(QuantizedWeights):
    """Fake-quantized routed experts in place of stacked experts (`is_stacked_experts`).

    `up_proj` [E, I, H] and `down_proj` [E, H, I] read as the fake-quantized weights, so the MoE layer
    that reads them is unchanged; the Parameters stay registered under the same names (state-dict keys
    as before, shared with the original module) and are what QAD trains. Each expert has its own scales,
    the layout Model Optimizer exports for Nemotron-H (one `experts.{j}.up_proj` with its weight,
    weight_scale and weight_scale_2 per expert):

        up_proj_global_scale [E], up_proj_block_scale [E, I, H // 16], and the same for down_proj.

    Weight-only: the MoE layer multiplies its activations by these weights directly, so only "w4a16"
    (NVFP4 weights, 16-bit activations) is accepted, the format of the routed experts in Model
    Optimizer's Nemotron recipes for Hopper-class serving.

    minispec's MoE (`minispec.ssm.hybrid`) reads the two properties; transformers' NemotronH MoE calls the
    experts module instead, `forward(hidden_states, top_k_index, top_k_weights)` below.
    """

    weight_names = EXPERT_WEIGHTS

    def __init__(self, experts: nn.Module, fmt: str, scales: str = "static"):
        super().__init__()
        if not is_stacked_experts(experts):
            raise ValueError("QuantExperts needs stacked experts (3-D up_proj and down_proj), "
                             f"got {type(experts).__name__}")
        if fmt != "w4a16":
            raise ValueError(f"routed experts take weight-only NVFP4 ('w4a16'), got {fmt!r}: the MoE layer reads "
                             "their weights directly, so their activations are not quantized")
        for name in EXPERT_WEIGHTS:
            k = getattr(experts, name).shape[-1]
            if k % nvfp4.BLOCK_SIZE:
                raise ValueError(f"NVFP4 needs {name}'s last dimension to be a multiple of {nvfp4.BLOCK_SIZE}, "
                                 f"got {k}")
            # Registered directly: the name is also the property below, which nn.Module's setattr would refuse.
            self._parameters[name] = getattr(experts, name)
        self.num_experts = experts.up_proj.shape[0]
        self.act_fn = getattr(experts, "act_fn", None)  # transformers' experts carry theirs; minispec's MoE applies it
        self._init_quantizer(fmt, scales, experts.up_proj.device)

    def extra_repr(self) -> str:
        E, inter, hidden = self.raw("up_proj").shape
        return (f"experts={E}, hidden={hidden}, intermediate={inter}, format={self.format}, scales={self.scales}"
                f"{', four_over_six' if self.four_over_six else ''}")

    @property
    def up_proj(self) -> torch.Tensor:
        """Ŵ_up [E, I, H] (straight-through estimator)."""
        return self.quantized("up_proj")

    @property
    def down_proj(self) -> torch.Tensor:
        """Ŵ_down [E, H, I] (straight-through estimator)."""
        return self.quantized("down_proj")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' NemotronHExperts call: x [T, H], top_k_index and top_k_weights [T, k] -> [T, H],
        Σ_k w_k · down_e(act(up_e(x))) over each token's chosen experts e (every expert computed, unchosen
        ones weighted 0: E is small here)."""
        if self.act_fn is None:
            raise RuntimeError("these experts came from a model whose MoE layer applies the activation itself: "
                               "read up_proj / down_proj instead of calling the module")
        w = torch.zeros(*top_k_index.shape[:-1], self.num_experts, dtype=top_k_weights.dtype,
                        device=hidden_states.device).scatter(-1, top_k_index, top_k_weights)
        h = self.act_fn(torch.einsum("td,eid->tei", hidden_states, self.up_proj.to(hidden_states.dtype)))
        y = torch.einsum("tei,edi->ted", h, self.down_proj.to(hidden_states.dtype))
        return torch.einsum("te,ted->td", w.to(y.dtype), y)

    def packed_experts(self) -> dict[str, torch.Tensor]:
        """Per expert j and projection, Model Optimizer's Nemotron-H export names and shapes:
        `{j}.up_proj.weight` uint8 [I, H // 2], `{j}.up_proj.weight_scale` float8_e4m3fn [I, H // 16],
        `{j}.up_proj.weight_scale_2` float32 [], and the same for down_proj."""
        out = {}
        for name in EXPERT_WEIGHTS:
            for field, t in self.packed(name).items():
                for j in range(self.num_experts):
                    out[f"{j}.{name}.{field}"] = t[j]
        return out


class PackedLinear(nn.Module):
    """A linear layer that serves from packed storage (what an exported checkpoint loads into).

    w4a16: y = w4a16_matmul(x, W) — the NVFP4 weight stays packed and is dequantized inside the GEMM
    (Triton kernel kernels/gemm.py where the backend picks it). w4a4: y = w4a4_matmul(x, W, input_scale),
    x quantized to NVFP4 with the stored input scale inside the GEMM too. fp8: E4M3 weight times
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
            rows = x.reshape(-1, self.in_features).contiguous()
            y = (w4a4_matmul(rows, self.nvfp4_weight(), self.input_scale.float().reshape(()))
                 if self.format == "w4a4" else w4a16_matmul(rows, self.nvfp4_weight()))
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)
