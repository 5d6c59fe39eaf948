"""Mamba-2 reference: the mixer with its real parameterisation, as a step recurrence and as the chunked SSD scan.

Notation (Dao & Gu 2024, "Transformers are SSMs", the SSD paper), per layer:

    b  batch             T  tokens            D  hidden_size (model width)
    H  heads             P  head_dim          N  state_size
    G  groups (heads h with h // (H/G) == g share B and C)
    K  conv_kernel       Q  chunk_size        d_inner = H * P,  conv_dim = d_inner + 2 * G * N

One token through the mixer (the names of the functions below in brackets):

    z, xBC, dt_raw = in_proj(u)                                   [split_projection]
    xBC            = act(depthwise causal conv1d over time(xBC))  [causal_conv1d]   (x, B and C are all convolved)
    x, B, C        = xBC                                          [split_xbc]
    dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit);  A = -exp(A_log);  a = exp(dt * A)   [discretize]
    h  = a * h + dt * x B^T        (per head: h is P x N, a and dt are scalars)                    [ssd_step]
    y  = h C + D * x
    out = out_proj(gated_rms_norm(y, z))   # RMSNorm(y * silu(z)), normalised per group of d_inner/G channels

The same map over T tokens is computed either token by token (`ssd_sequential`, the spec) or by the
chunked SSD scan (`ssd_chunked`): inside a chunk a masked "attention-like" quadratic form with the
segment-sum decay matrix, across chunks a recurrence on the P x N states.

State layout (`Mamba2State`), one per layer and sequence:

    conv  [b, conv_dim, K-1]   the last K-1 *pre-conv* xBC columns, oldest first (the newest is [..., -1]).
                               This is the minimal rolling window (vLLM's layout). transformers keeps K columns
                               (one more, never read); `conv_state_to_hf` / `conv_state_from_hf` convert.
    ssm   [b, H, P, N]         h, in float32 (or float64 when the activations are float64).

Parameter names and shapes equal transformers' `NemotronHMamba2Mixer` (a state dict loads into either):
`in_proj.weight [H*P + conv_dim + H, D]`, `conv1d.weight [conv_dim, 1, K]`, `conv1d.bias [conv_dim]`,
`dt_bias [H]`, `A_log [H]`, `D [H]`, `norm.weight [H*P]`, `out_proj.weight [D, H*P]`
(+ `in_proj.bias`, `out_proj.bias` when `use_bias`).

The mixer: `forward(u [b, T, D], state=None, attention_mask=None) -> (out, state)` (chunked scan),
`step(u [b, D], state) -> (out, state)` (recurrence), and the two halves around the scan,
`scan_inputs(u, state) -> Mamba2ScanInputs` and `scan_output(y, z)`, for code that runs its own scan
(checkpoint + replay).

Where transformers' NemotronH mixer (5.24) departs from the textbook, and what this file does:
  * dt clamp: it clamps dt >= config.time_step_min in its chunked path only (its step path does not clamp,
    and the config's own `time_step_limit` field is ignored). Here one `time_step_limit` serves both paths;
    `Mamba2Config.from_nemotron_h` picks (time_step_min, inf), the value of its prefill.
  * precision: its torch scans run in float32 even for float64 inputs; here the scan runs in
    promote(activation dtype, float32).
  * conv state: it keeps K columns, here K-1 (see above).
  * `expand` is unused: d_inner = mamba_num_heads * mamba_head_dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "Mamba2Config",
    "Mamba2State",
    "Mamba2StateError",
    "Mamba2Mixer",
    "Mamba2ScanInputs",
    "GatedRMSNorm",
    "check_state",
    "split_projection",
    "split_xbc",
    "causal_conv1d",
    "discretize",
    "segsum",
    "ssd_step",
    "ssd_sequential",
    "ssd_chunked",
    "gated_rms_norm",
    "conv_state_to_hf",
    "conv_state_from_hf",
]

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


# --------------------------------------------------------------------------------------------------
# Configuration and state
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mamba2Config:
    """The shape and numerics of one Mamba-2 mixer.

    Field names follow the Mamba-2 paper; `from_nemotron_h` / `to_nemotron_h_kwargs` map them to and
    from transformers' `NemotronHConfig` (in brackets):

    hidden_size (hidden_size) D; num_heads (mamba_num_heads) H; head_dim (mamba_head_dim) P;
    state_size (ssm_state_size) N; n_groups (n_groups) G; conv_kernel (conv_kernel) K;
    chunk_size (chunk_size) Q; use_conv_bias (use_conv_bias); use_bias (use_bias: in_proj/out_proj);
    hidden_act (mamba_hidden_act); layer_norm_epsilon (layer_norm_epsilon: the gated norm's eps);
    time_step_min/max/floor (same names: the dt_bias initialisation only).

    time_step_limit: (lo, hi) clamp of dt = softplus(dt_raw + dt_bias), applied identically by the
    chunked and the step path. transformers' NemotronH mixer uses (time_step_min, inf) in its chunked
    path and no clamp at all in its step path (and ignores the config field `time_step_limit`);
    `from_nemotron_h` picks its chunked-path value by default, see there.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 128
    use_conv_bias: bool = True
    use_bias: bool = False
    hidden_act: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    layer_norm_epsilon: float = 1e-5
    time_step_min: float = 1e-3
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Mamba2Config.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"Mamba2Config: num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups}); "
                "each group of num_heads/n_groups heads shares one B and one C"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"Mamba2Config.hidden_act {self.hidden_act!r} is not one of {sorted(_ACTIVATIONS)}")
        lo, hi = self.time_step_limit
        if not (0.0 <= lo <= hi):
            raise ValueError(f"Mamba2Config.time_step_limit must satisfy 0 <= lo <= hi, got {self.time_step_limit}")
        object.__setattr__(self, "time_step_limit", (float(lo), float(hi)))

    # derived sizes ------------------------------------------------------------------------------
    @property
    def intermediate_size(self) -> int:
        """d_inner = H * P (NemotronH derives it from heads x head_dim; its `expand` field is unused)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: x (d_inner), B (G*N) and C (G*N)."""
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def projection_size(self) -> int:
        """Output width of in_proj: z (d_inner) + xBC (conv_dim) + dt (H)."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.n_groups

    @property
    def norm_group_size(self) -> int:
        """The gated RMSNorm normalises each group of d_inner / G channels separately."""
        return self.intermediate_size // self.n_groups

    # transformers interop -----------------------------------------------------------------------
    @classmethod
    def from_nemotron_h(cls, hf_config: Any, *, time_step_limit: tuple[float, float] | None = None) -> "Mamba2Config":
        """Read the Mamba fields of a transformers `NemotronHConfig` (or any object with those attributes).

        `time_step_limit` defaults to (hf_config.time_step_min, inf): what transformers' mixer really
        applies in its chunked (prefill) path, so prefill outputs agree with it. Its step path clamps
        nothing; pass (0.0, inf) to reproduce that (and vLLM / mamba_ssm, whose default is (0, inf)).
        """
        limit = (float(hf_config.time_step_min), math.inf) if time_step_limit is None else time_step_limit
        return cls(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.mamba_num_heads,
            head_dim=hf_config.mamba_head_dim,
            state_size=hf_config.ssm_state_size,
            n_groups=hf_config.n_groups,
            conv_kernel=hf_config.conv_kernel,
            chunk_size=hf_config.chunk_size,
            use_conv_bias=bool(hf_config.use_conv_bias),
            use_bias=bool(hf_config.use_bias),
            hidden_act=hf_config.mamba_hidden_act,
            time_step_limit=tuple(limit),
            layer_norm_epsilon=float(hf_config.layer_norm_epsilon),
            time_step_min=float(hf_config.time_step_min),
            time_step_max=float(hf_config.time_step_max),
            time_step_floor=float(hf_config.time_step_floor),
        )

    def to_nemotron_h_kwargs(self) -> dict[str, Any]:
        """The `NemotronHConfig(**kwargs)` Mamba fields for this mixer.

        Round trip: `from_nemotron_h(NemotronHConfig(**kw))` gives back this config when
        `time_step_limit == (time_step_min, inf)`; transformers cannot express another clamp.
        """
        return {
            "hidden_size": self.hidden_size,
            "mamba_num_heads": self.num_heads,
            "mamba_head_dim": self.head_dim,
            "ssm_state_size": self.state_size,
            "n_groups": self.n_groups,
            "conv_kernel": self.conv_kernel,
            "chunk_size": self.chunk_size,
            "use_conv_bias": self.use_conv_bias,
            "use_bias": self.use_bias,
            "mamba_hidden_act": self.hidden_act,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "time_step_min": self.time_step_min,
            "time_step_max": self.time_step_max,
            "time_step_floor": self.time_step_floor,
        }


class Mamba2StateError(ValueError):
    """A Mamba-2 state has the wrong shape or holds NaN/inf values."""


def _state_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    """The SSM state (and the scan) run in float32, or in float64 for float64 activations."""
    return torch.promote_types(activation_dtype, torch.float32)


@dataclass
class Mamba2State:
    """The recurrent state of one Mamba-2 layer for a batch of sequences.

    conv: [b, conv_dim, K-1]  last K-1 pre-conv xBC inputs, oldest first, activation dtype.
    ssm:  [b, H, P, N]        the SSM state h, float32 (float64 for float64 activations).

    Functions never modify a state in place; they return a new one. `clone()` is a deep copy
    (what a speculative decoder keeps to roll back).
    """

    conv: Tensor
    ssm: Tensor

    @classmethod
    def zeros(
        cls,
        config: Mamba2Config,
        batch_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "Mamba2State":
        """The state before any token. `dtype` is the activation dtype; the ssm part uses `_state_dtype`."""
        conv = torch.zeros(batch_size, config.conv_dim, config.conv_kernel - 1, dtype=dtype, device=device)
        ssm = torch.zeros(
            batch_size, config.num_heads, config.head_dim, config.state_size, dtype=_state_dtype(dtype), device=device
        )
        return cls(conv=conv, ssm=ssm)

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[0]

    def clone(self) -> "Mamba2State":
        return Mamba2State(conv=self.conv.clone(), ssm=self.ssm.clone())

    def nbytes(self) -> int:
        """Bytes held by this state (conv window + SSM state)."""
        return self.conv.numel() * self.conv.element_size() + self.ssm.numel() * self.ssm.element_size()


def check_state(
    state: Mamba2State,
    config: Mamba2Config | None = None,
    *,
    batch_size: int | None = None,
    name: str = "Mamba2 state",
    check_finite: bool = True,
) -> Mamba2State:
    """Raise `Mamba2StateError` if `state` has the wrong shapes (given `config` / `batch_size`) or holds NaN/inf.

    `name` goes into the message (the mixer passes e.g. "Mamba2Mixer layer 3, incoming state"), so a
    poisoned state is reported where it is first seen instead of silently spreading through the
    recurrence: once h holds a NaN, every later output of that sequence is NaN. Returns `state`.
    """
    if not isinstance(state, Mamba2State):
        raise Mamba2StateError(f"{name}: expected a Mamba2State, got {type(state).__name__}")
    conv, ssm = state.conv, state.ssm
    if conv.dim() != 3 or ssm.dim() != 4:
        raise Mamba2StateError(
            f"{name}: conv must be [b, conv_dim, K-1] and ssm [b, H, P, N]; "
            f"got conv {tuple(conv.shape)}, ssm {tuple(ssm.shape)}"
        )
    if conv.shape[0] != ssm.shape[0]:
        raise Mamba2StateError(f"{name}: conv batch {conv.shape[0]} != ssm batch {ssm.shape[0]}")
    if batch_size is not None and ssm.shape[0] != batch_size:
        raise Mamba2StateError(f"{name}: state batch {ssm.shape[0]} != input batch {batch_size}")
    if config is not None:
        want_conv = (config.conv_dim, config.conv_kernel - 1)
        want_ssm = (config.num_heads, config.head_dim, config.state_size)
        if tuple(conv.shape[1:]) != want_conv:
            hint = ""
            if conv.shape[-1] == config.conv_kernel:
                hint = " (a transformers-layout conv state has K columns: use conv_state_from_hf)"
            raise Mamba2StateError(
                f"{name}: conv state has shape {tuple(conv.shape)}, "
                f"expected [b, conv_dim, K-1] = [b, {want_conv[0]}, {want_conv[1]}]{hint}"
            )
        if tuple(ssm.shape[1:]) != want_ssm:
            raise Mamba2StateError(
                f"{name}: ssm state has shape {tuple(ssm.shape)}, "
                f"expected [b, H, P, N] = [b, {want_ssm[0]}, {want_ssm[1]}, {want_ssm[2]}]"
            )
    if check_finite:
        for part, tensor in (("ssm", ssm), ("conv", conv)):
            bad = ~torch.isfinite(tensor)
            if bad.any():
                first = tuple(int(i) for i in bad.nonzero()[0])
                kinds = []
                if torch.isnan(tensor).any():
                    kinds.append("NaN")
                if torch.isinf(tensor).any():
                    kinds.append("inf")
                raise Mamba2StateError(
                    f"{name}: state.{part} holds {int(bad.sum())} non-finite value(s) ({'/'.join(kinds)}) of "
                    f"{tensor.numel()}, first at index {first}; refusing to propagate it"
                )
    return state


def conv_state_to_hf(conv: Tensor) -> Tensor:
    """[b, conv_dim, K-1] -> transformers' [b, conv_dim, K]: prepend the column HF keeps but never reads (zeros)."""
    return F.pad(conv, (1, 0))


def conv_state_from_hf(conv: Tensor) -> Tensor:
    """transformers' [b, conv_dim, K] -> [b, conv_dim, K-1]: drop the oldest column (outside the kernel's reach)."""
    return conv[..., 1:]


# --------------------------------------------------------------------------------------------------
# The pieces, as functions
# --------------------------------------------------------------------------------------------------


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def split_projection(zxbcdt: Tensor, config: Mamba2Config) -> tuple[Tensor, Tensor, Tensor]:
    """Split the in_proj output [b, T, d_inner + conv_dim + H] into
    z [b, T, d_inner], xBC [b, T, conv_dim] and dt_raw [b, T, H].

    The order [z, xBC, dt] is the one of mamba_ssm and transformers.
    """
    _require(
        zxbcdt.shape[-1] == config.projection_size,
        f"split_projection: last dim is {zxbcdt.shape[-1]}, expected d_inner + conv_dim + H = {config.projection_size}",
    )
    return zxbcdt.split([config.intermediate_size, config.conv_dim, config.num_heads], dim=-1)


def split_xbc(xBC: Tensor, config: Mamba2Config) -> tuple[Tensor, Tensor, Tensor]:
    """Split the (post-conv) xBC [b, T, conv_dim] into x [b, T, H, P], B [b, T, G, N], C [b, T, G, N]."""
    _require(
        xBC.shape[-1] == config.conv_dim,
        f"split_xbc: last dim is {xBC.shape[-1]}, expected conv_dim = {config.conv_dim}",
    )
    gn = config.n_groups * config.state_size
    x, B, C = xBC.split([config.intermediate_size, gn, gn], dim=-1)
    lead = xBC.shape[:-1]
    return (
        x.reshape(*lead, config.num_heads, config.head_dim),
        B.reshape(*lead, config.n_groups, config.state_size),
        C.reshape(*lead, config.n_groups, config.state_size),
    )


def causal_conv1d(
    xBC: Tensor, weight: Tensor, bias: Tensor | None = None, conv_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution over time, continuing from a rolling window (no activation).

    xBC:        [b, T, C]      the new pre-conv inputs (channels last, as in_proj gives them)
    weight:     [C, K] or [C, 1, K] (nn.Conv1d's layout); tap k multiplies the input k - (K-1) steps back
    bias:       [C] or None
    conv_state: [b, C, K-1]    the K-1 inputs before xBC, oldest first; None means zeros (start of sequence)
    returns:    out [b, T, C]  out[t] = bias + sum_k weight[:, k] * window[t + k], window = state ++ xBC
                new_state [b, C, K-1]  the last K-1 columns of the window

    With T = 1 this is the per-token rolling update; over a whole prompt from a zero state it equals
    `F.conv1d(..., padding=K-1, groups=C)` cut to the first T outputs.
    """
    if weight.dim() == 3:
        _require(weight.shape[1] == 1, f"causal_conv1d: weight {tuple(weight.shape)} is not depthwise [C, 1, K]")
        weight = weight[:, 0]
    _require(xBC.dim() == 3, f"causal_conv1d: xBC must be [b, T, C], got {tuple(xBC.shape)}")
    b, T, C = xBC.shape
    _require(
        weight.dim() == 2 and weight.shape[0] == C,
        f"causal_conv1d: weight {tuple(weight.shape)} does not match C = {C}",
    )
    K = weight.shape[1]
    if conv_state is None:
        conv_state = xBC.new_zeros(b, C, K - 1)
    _require(
        tuple(conv_state.shape) == (b, C, K - 1),
        f"causal_conv1d: conv_state has shape {tuple(conv_state.shape)}, expected [b, C, K-1] = {(b, C, K - 1)}",
    )
    window = torch.cat([conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)  # [b, C, K-1+T]
    out = sum(weight[:, k, None] * window[:, :, k : k + T] for k in range(K))  # [b, C, T]
    if bias is not None:
        out = out + bias[:, None]
    new_state = window[:, :, window.shape[-1] - (K - 1) :]
    return out.transpose(1, 2), new_state


def discretize(
    dt_raw: Tensor, dt_bias: Tensor, A_log: Tensor, time_step_limit: tuple[float, float] = (0.0, math.inf)
) -> tuple[Tensor, Tensor]:
    """Zero-order-hold discretisation of the scalar-per-head SSM.

    dt_raw: [..., H] (from in_proj), dt_bias: [H], A_log: [H]
    returns dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit)  [..., H]   (the step size, > 0)
            A  = -exp(A_log)                                          [H]        (< 0)
    The per-token decay of head h is a = exp(dt * A) in (0, 1); `ssd_step` and `ssd_chunked` use
    dt * A (the log-decay) and dt * x B^T (the input). Softplus passes values above 20 through.
    Computed in the dtype of dt_raw (upcast it first to run in float32/float64).
    """
    _require(
        dt_raw.shape[-1] == dt_bias.shape[-1] == A_log.shape[-1],
        f"discretize: dt_raw [..., {dt_raw.shape[-1]}], dt_bias {tuple(dt_bias.shape)} "
        f"and A_log {tuple(A_log.shape)} must share H",
    )
    dt = F.softplus(dt_raw + dt_bias.to(dt_raw.dtype))
    lo, hi = time_step_limit
    if lo > 0.0 or hi < math.inf:
        dt = dt.clamp(min=lo, max=hi)
    A = -torch.exp(A_log.to(dt_raw.dtype))
    return dt, A


def _heads(BC: Tensor, num_heads: int) -> Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H/G)."""
    return BC.repeat_interleave(num_heads // BC.shape[-2], dim=-2)


def _check_ssd_shapes(fn: str, x, dt, A, B, C, D, h0, lead: int) -> None:
    """Shape checks shared by the ssd_* functions; lead = 1 for [b, ...] (one token), 2 for [b, T, ...]."""
    layout = "[b, T, H, P]" if lead == 2 else "[b, H, P]"
    _require(x.dim() == lead + 2, f"{fn}: x must be {layout}, got {tuple(x.shape)}")
    *bt, H, P = x.shape
    _require(tuple(dt.shape) == (*bt, H), f"{fn}: dt has shape {tuple(dt.shape)}, expected {(*bt, H)}")
    _require(tuple(A.shape) == (H,), f"{fn}: A has shape {tuple(A.shape)}, expected ({H},)")
    _require(
        B.dim() == lead + 2 and tuple(B.shape[:lead]) == tuple(bt),
        f"{fn}: B has shape {tuple(B.shape)}, expected {(*bt, 'G', 'N')}",
    )
    _require(tuple(C.shape) == tuple(B.shape), f"{fn}: C {tuple(C.shape)} and B {tuple(B.shape)} must match")
    G, N = B.shape[-2:]
    _require(H % G == 0, f"{fn}: H = {H} heads is not a multiple of G = {G} groups")
    _require(D is None or tuple(D.shape) == (H,), f"{fn}: D has shape {getattr(D, 'shape', None)}, expected ({H},)")
    _require(
        h0 is None or tuple(h0.shape) == (bt[0], H, P, N),
        f"{fn}: state has shape {tuple(h0.shape) if h0 is not None else None}, "
        f"expected [b, H, P, N] = {(bt[0], H, P, N)}",
    )


def ssd_step(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One token of the SSM recurrence (the spec every other form is tested against).

    state [b, H, P, N], x [b, H, P], dt [b, H], A [H], B, C [b, G, N], D [H] or None
    returns y [b, H, P] and the new state [b, H, P, N]:
        h_new = exp(dt * A) * h + dt * x B^T        (the decay applies to the old state only)
        y     = h_new C + D * x
    Nothing is modified in place.
    """
    _check_ssd_shapes("ssd_step", x, dt, A, B, C, D, state, lead=1)
    H = x.shape[1]
    Bh, Ch = _heads(B, H), _heads(C, H)  # [b, H, N]
    decay = torch.exp(dt * A)  # [b, H]
    new_state = decay[:, :, None, None] * state + (dt[:, :, None] * x)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch)
    if D is not None:
        y = y + D[:, None] * x
    return y, new_state


def ssd_sequential(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The recurrence, one token at a time: a loop of `ssd_step`. The naive spec for the chunked scan.

    x [b, T, H, P], dt [b, T, H], A [H], B, C [b, T, G, N], D [H] or None, initial_state [b, H, P, N] or None (zeros)
    returns y [b, T, H, P] and the final state [b, H, P, N].
    """
    _check_ssd_shapes("ssd_sequential", x, dt, A, B, C, D, initial_state, lead=2)
    b, T, H, P = x.shape
    h = initial_state if initial_state is not None else x.new_zeros(b, H, P, B.shape[-1])
    ys = []
    for t in range(T):
        y_t, h = ssd_step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y_t)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)
    return y, h


def segsum(log_a: Tensor) -> Tensor:
    """Segment sums of log-decays: [..., Q] -> [..., Q, Q].

    out[..., t, s] = log_a[s+1] + ... + log_a[t]  for s <= t   (0 on the diagonal: an empty sum)
                   = -inf                          for s >  t   (so exp() gives the causal mask)
    exp(out[t, s]) is the decay a token s's contribution has accumulated by the time t is read:
    the decays of the tokens *after* s up to and including t, never s's own.
    Built as a cumulative sum down each column of a strictly-lower-triangular copy of log_a, so
    no two large cumulative sums are subtracted (the numerically careful form).
    """
    Q = log_a.shape[-1]
    rows = log_a[..., :, None].expand(*log_a.shape, Q)  # [..., t, s] = log_a[t]
    strictly_lower = torch.ones(Q, Q, dtype=torch.bool, device=log_a.device).tril(-1)
    out = rows.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)  # [t, s] = sum_{s < j <= t} log_a[j]
    causal = torch.ones(Q, Q, dtype=torch.bool, device=log_a.device).tril()
    return out.masked_fill(~causal, -math.inf)


def ssd_chunked(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 128,
) -> tuple[Tensor, Tensor]:
    """The chunked SSD scan (Dao & Gu 2024, section 6): same inputs and outputs as `ssd_sequential`.

    x [b, T, H, P], dt [b, T, H], A [H], B, C [b, T, G, N], D [H] or None, initial_state [b, H, P, N] or None
    returns y [b, T, H, P] and the final state [b, H, P, N]. T need not be a multiple of chunk_size
    (the last chunk is simply shorter).

    For each chunk of Q tokens with log-decays l_s = dt_s * A and cum_t = l_0 + ... + l_t (inclusive),
    starting from the state h entering the chunk:

      1. intra-chunk, the "diagonal block" (a masked attention with scores C_t . B_s):
             y_t  = sum_{s <= t} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s        exp(segsum(l))[t, s]
      2. the entering state, read at t: it has decayed through tokens 0..t, t's own decay included:
             y_t += exp(cum_t) (h C_t)
      3. state passing to the next chunk: token s decays through s+1..Q-1 only (not its own l_s):
             h    = exp(cum_{Q-1}) h + sum_s exp(cum_{Q-1} - cum_s) dt_s x_s B_s^T
    and finally y += D * x. Steps 1, 2 are parallel over the chunk; step 3 is a recurrence over
    T/Q chunks instead of T tokens (the Triton kernels run it serially too).
    """
    _check_ssd_shapes("ssd_chunked", x, dt, A, B, C, D, initial_state, lead=2)
    _require(
        isinstance(chunk_size, int) and chunk_size >= 1,
        f"ssd_chunked: chunk_size must be a positive int, got {chunk_size!r}",
    )
    b, T, H, P = x.shape
    N = B.shape[-1]
    Bh, Ch = _heads(B, H), _heads(C, H)  # [b, T, H, N]
    xdt = x * dt[..., None]  # [b, T, H, P]   the input, scaled by its step size
    log_a = (dt * A).transpose(1, 2)  # [b, H, T]     log-decays, <= 0
    h = initial_state if initial_state is not None else x.new_zeros(b, H, P, N)
    ys = []
    for start in range(0, T, chunk_size):
        c = slice(start, min(start + chunk_size, T))
        xc, Bc, Cc, lc = xdt[:, c], Bh[:, c], Ch[:, c], log_a[:, :, c]  # [b,q,H,P] [b,q,H,N] [b,q,H,N] [b,H,q]
        cum = lc.cumsum(dim=-1)  # [b, H, q]
        # 1. intra-chunk quadratic form
        scores = torch.einsum("bthn,bshn->bhts", Cc, Bc)  # C_t . B_s
        y = torch.einsum("bhts,bshp->bthp", scores * torch.exp(segsum(lc)), xc)
        # 2. contribution of the state entering the chunk
        y = y + torch.einsum("bthn,bhpn->bthp", Cc, h) * torch.exp(cum).transpose(1, 2)[..., None]
        # 3. the state leaving the chunk
        to_end = torch.exp(cum[:, :, -1:] - cum)  # [b, H, q]
        h = torch.exp(cum[:, :, -1])[..., None, None] * h + torch.einsum("bhs,bshp,bshn->bhpn", to_end, xc, Bc)
        ys.append(y)
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(b, 0, H, P)
    if D is not None:
        y = y + D[:, None] * x
    return y, h


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, group_size: int, eps: float = 1e-5) -> Tensor:
    """weight * RMSNorm(y * silu(z)), the RMS taken over each group of `group_size` channels separately.

    y, z: [..., d_inner], weight: [d_inner], group_size divides d_inner (Mamba-2 uses d_inner / G, so
    norm groups line up with the B/C groups). The gate comes *before* the norm (mamba_ssm's
    `norm_before_gate=False`, which NemotronH uses). Computed in float32 or wider; returns that dtype.
    """
    _require(y.shape == z.shape, f"gated_rms_norm: y {tuple(y.shape)} and z {tuple(z.shape)} must match")
    d = y.shape[-1]
    _require(
        weight.shape == (d,) and d % group_size == 0,
        f"gated_rms_norm: weight {tuple(weight.shape)} / group_size {group_size} do not fit d_inner = {d}",
    )
    dtype = _state_dtype(y.dtype)
    g = y.to(dtype) * F.silu(z.to(dtype))
    g = g.unflatten(-1, (d // group_size, group_size))
    g = g * torch.rsqrt(g.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight.to(dtype) * g.flatten(-2)


@dataclass
class Mamba2ScanInputs:
    """What the SSM scan of one mixer call consumes (`Mamba2Mixer.scan_inputs`); z and conv ride along.

    z [b, T, d_inner] (gate, activation dtype); x [b, T, H, P]; dt [b, T, H] (after softplus and clamp);
    A [H]; B, C [b, T, G, N]; D [H]; conv [b, conv_dim, K-1] (the conv window after these T tokens).
    x, dt, B (and C for the outputs) are the per-token records a checkpoint + replay buffer caches.
    xbc [b, T, conv_dim] is the pre-conv input of these tokens: the conv window after the first n of
    them is the last K-1 columns of (incoming conv ++ xbc[:, :n]), which is how a rollback rebuilds it.
    """

    z: Tensor
    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Tensor
    conv: Tensor
    xbc: Tensor | None = None


# --------------------------------------------------------------------------------------------------
# The mixer
# --------------------------------------------------------------------------------------------------


class GatedRMSNorm(nn.Module):
    """The module around `gated_rms_norm`; its one parameter is `weight` [d_inner] (state-dict name `norm.weight`)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, group_size={self.group_size}, eps={self.eps}"


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer of one layer: [b, T, D] -> [b, T, D], carrying a `Mamba2State`.

    forward(hidden_states [b, T, D], state=None, attention_mask=None) -> (out [b, T, D], new_state)
        the prefill / multi-token path (chunked SSD scan), continuing from `state` (zeros if None).
    step(hidden_state [b, D] or [b, 1, D], state=None) -> (out of the same shape, new_state)
        one token through the step recurrence.
    Both check the incoming state (shapes, finiteness) and the state they produce, and raise
    `Mamba2StateError` naming this layer; set `check_finite = False` to skip the NaN/inf scan.
    The ssm state is kept in float32 (float64 for float64 activations); the scan runs in that dtype.
    """

    check_finite: bool = True

    def __init__(self, config: Mamba2Config, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        cfg = config
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.projection_size, bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(
            cfg.conv_dim, cfg.conv_dim, kernel_size=cfg.conv_kernel, groups=cfg.conv_dim,
            padding=cfg.conv_kernel - 1, bias=cfg.use_conv_bias,
        )  # a parameter holder (weight [conv_dim, 1, K]); the maths is in `causal_conv1d`
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_heads))
        self.D = nn.Parameter(torch.empty(cfg.num_heads))
        self.norm = GatedRMSNorm(cfg.intermediate_size, cfg.norm_group_size, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.use_bias)
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.reset_ssm_parameters()

    @torch.no_grad()
    def reset_ssm_parameters(self, generator: torch.Generator | None = None) -> None:
        """The standard Mamba-2 initialisation, as in transformers' NemotronH and mamba_ssm:
        A_log = log(1..H) (A = -1, -2, ..., -H), D = 1, dt_bias = softplus^-1(dt0) with dt0 log-uniform
        in [time_step_min, time_step_max], floored at time_step_floor; the gated norm's weight = 1."""
        cfg = self.config
        self.A_log.copy_(torch.log(torch.arange(1, cfg.num_heads + 1, dtype=torch.float64)))
        self.D.fill_(1.0)
        lo, hi = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
        u = torch.rand(cfg.num_heads, generator=generator, dtype=torch.float64)
        dt0 = torch.exp(lo + u * (hi - lo)).clamp(min=cfg.time_step_floor)
        self.dt_bias.copy_(dt0 + torch.log(-torch.expm1(-dt0)))  # inverse softplus
        self.norm.weight.fill_(1.0)

    @property
    def _where(self) -> str:
        return "Mamba2Mixer" if self.layer_idx is None else f"Mamba2Mixer layer {self.layer_idx}"

    def init_state(
        self, batch_size: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> Mamba2State:
        """A zero state; dtype defaults to the parameters' dtype (the activation dtype)."""
        dtype = self.in_proj.weight.dtype if dtype is None else dtype
        device = self.in_proj.weight.device if device is None else device
        return Mamba2State.zeros(self.config, batch_size, dtype=dtype, device=device)

    def _incoming(self, hidden_states: Tensor, state: Mamba2State | None) -> Mamba2State:
        if state is None:
            return self.init_state(hidden_states.shape[0], dtype=hidden_states.dtype, device=hidden_states.device)
        return check_state(
            state, self.config, batch_size=hidden_states.shape[0],
            name=f"{self._where}, incoming state", check_finite=self.check_finite,
        )

    def _outgoing(self, state: Mamba2State) -> Mamba2State:
        if self.check_finite:
            check_state(state, name=f"{self._where}, state produced from this input (NaN/inf in the input or weights?)")
        return state

    def scan_inputs(
        self, hidden_states: Tensor, state: Mamba2State | None = None, attention_mask: Tensor | None = None
    ) -> "Mamba2ScanInputs":
        """Everything before the SSM scan: in_proj, split, causal conv (from state.conv), activation, discretize.

        hidden_states [b, T, D], state (only state.conv and the ssm dtype are used; None = zeros),
        attention_mask [b, T] or None. Returns a `Mamba2ScanInputs` (x, B, C, dt, A, D in the scan dtype).
        """
        cfg = self.config
        if state is None:
            state = self.init_state(hidden_states.shape[0], dtype=hidden_states.dtype, device=hidden_states.device)
        mask = None
        if attention_mask is not None:
            _require(
                tuple(attention_mask.shape) == tuple(hidden_states.shape[:2]),
                f"{self._where}: attention_mask must be [b, T] = {tuple(hidden_states.shape[:2])}, "
                f"got {tuple(attention_mask.shape)}",
            )
            mask = attention_mask[..., None].to(hidden_states.dtype)
            hidden_states = hidden_states * mask  # padding writes nothing ...
        z, xbc, dt_raw = split_projection(self.in_proj(hidden_states), cfg)
        xBC, conv = causal_conv1d(xbc, self.conv1d.weight, self.conv1d.bias, state.conv)
        xBC = self.act(xBC)
        if mask is not None:
            xBC = xBC * mask  # ... and reads nothing through the conv window
        sdt = state.ssm.dtype
        x, B, C = (t.to(sdt) for t in split_xbc(xBC, cfg))
        dt, A = discretize(dt_raw.to(sdt), self.dt_bias, self.A_log, cfg.time_step_limit)
        return Mamba2ScanInputs(z=z, x=x, dt=dt, A=A, B=B, C=C, D=self.D.to(sdt), conv=conv.to(state.conv.dtype),
                                xbc=xbc)

    def scan_output(self, y: Tensor, z: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Everything after the scan: y [b, T, H, P], z [b, T, d_inner] -> out_proj(gated_rms_norm(y, z)) [b, T, D].
        `dtype` is the activation dtype to return (default: out_proj's weight dtype)."""
        dtype = self.out_proj.weight.dtype if dtype is None else dtype
        return self.out_proj(self.norm(y.flatten(-2), z).to(dtype))

    def forward(
        self, hidden_states: Tensor, state: Mamba2State | None = None, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Mamba2State]:
        """Prefill / multi-token path (the chunked SSD scan).

        hidden_states:  [b, T, D]
        state:          Mamba2State or None (start of sequence)
        attention_mask: [b, T] (1 = token, 0 = padding) or None; as in transformers, padded positions
                        are zeroed before in_proj and after the conv, so they add nothing to the state
                        (left padding is the supported layout).
        returns:        out [b, T, D] and the state after the T tokens.
        """
        cfg = self.config
        _require(
            hidden_states.dim() == 3 and hidden_states.shape[-1] == cfg.hidden_size,
            f"{self._where}.forward: hidden_states must be [b, T, {cfg.hidden_size}], got {tuple(hidden_states.shape)}",
        )
        state = self._incoming(hidden_states, state)
        s = self.scan_inputs(hidden_states, state, attention_mask)
        y, ssm = ssd_chunked(s.x, s.dt, s.A, s.B, s.C, s.D, state.ssm, chunk_size=cfg.chunk_size)
        out = self.scan_output(y, s.z, hidden_states.dtype)
        return out, self._outgoing(Mamba2State(conv=s.conv, ssm=ssm))

    def step(self, hidden_state: Tensor, state: Mamba2State | None = None) -> tuple[Tensor, Mamba2State]:
        """One token through the step recurrence.

        hidden_state: [b, D] or [b, 1, D];  state: Mamba2State or None (zeros)
        returns:      out with the shape of hidden_state, and the state after this token.
        """
        cfg = self.config
        squeeze = hidden_state.dim() == 2
        u = hidden_state[:, None] if squeeze else hidden_state
        _require(
            u.dim() == 3 and u.shape[1] == 1 and u.shape[-1] == cfg.hidden_size,
            f"{self._where}.step: hidden_state must be [b, {cfg.hidden_size}] or [b, 1, {cfg.hidden_size}], "
            f"got {tuple(hidden_state.shape)}",
        )
        state = self._incoming(u, state)
        s = self.scan_inputs(u, state)
        y, ssm = ssd_step(state.ssm, s.x[:, 0], s.dt[:, 0], s.A, s.B[:, 0], s.C[:, 0], s.D)
        out = self.scan_output(y[:, None], s.z, u.dtype)
        new_state = self._outgoing(Mamba2State(conv=s.conv, ssm=ssm))
        return (out[:, 0] if squeeze else out), new_state

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"H={c.num_heads}, P={c.head_dim}, N={c.state_size}, G={c.n_groups}, K={c.conv_kernel}, "
            f"chunk={c.chunk_size}, dt_limit={c.time_step_limit}"
        )
