"""The Mamba-2 mixer of one layer (`Mamba2Mixer`), with the parameterisation of transformers' NemotronH mixer.

One token through the mixer; the functions it calls are in brackets (the SSD math is `minispec.ssm.ssd`,
the sizes and their names `minispec.ssm.config`, the state it carries `minispec.ssm.state`):

    z, xBC, dt_raw = in_proj(u)                                   [split_projection]
    xBC            = act(depthwise causal conv1d over time(xBC))  [causal_conv1d]   (x, B and C are all convolved)
    x, B, C        = xBC                                          [split_xbc]
    dt, A          = discretize(dt_raw, dt_bias, A_log)           [discretize]
    y, h           = the SSM scan from h                          [ssd_chunked over T tokens, ssd_step for one]
    out            = out_proj(gated_rms_norm(y, z))               [gated_rms_norm]  RMSNorm(y * silu(z)) per group

Parameter names and shapes equal transformers' `NemotronHMamba2Mixer` (a state dict loads into either):
`in_proj.weight [H*P + conv_dim + H, D]`, `conv1d.weight [conv_dim, 1, K]`, `conv1d.bias [conv_dim]`,
`dt_bias [H]`, `A_log [H]`, `D [H]`, `norm.weight [H*P]`, `out_proj.weight [D, H*P]`
(+ `in_proj.bias`, `out_proj.bias` when `use_bias`).

The mixer: `forward(u [b, T, D], state=None, attention_mask=None) -> (out, state)` (chunked scan),
`step(u [b, D], state) -> (out, state)` (recurrence), and the two halves around the scan,
`scan_inputs(u, state) -> Mamba2ScanInputs` and `scan_output(y, z)`, for code that runs its own scan
(checkpoint + replay, `minispec.ssm.replay`).

Where transformers' NemotronH mixer (5.25) departs from the textbook, and what this file does:
  * precision: its torch scans run in float32 even for float64 inputs; here the scan runs in
    promote(activation dtype, float32) (`state_dtype`).
  * conv state: it keeps K columns, here K-1 (`minispec.ssm.state`).
  * `expand` is unused: d_inner = mamba_num_heads * mamba_head_dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from minispec.ssm.config import ACTIVATIONS, Mamba2Config
from minispec.ssm.ssd import causal_conv1d, discretize, gated_rms_norm, ssd_chunked, ssd_step
from minispec.ssm.state import Mamba2State, check_state

__all__ = ["Mamba2Mixer", "Mamba2ScanInputs", "GatedRMSNorm", "split_projection", "split_xbc"]


def split_projection(zxbcdt: Tensor, config: Mamba2Config) -> tuple[Tensor, Tensor, Tensor]:
    """Split the in_proj output [b, T, d_inner + conv_dim + H] into
    z [b, T, d_inner], xBC [b, T, conv_dim] and dt_raw [b, T, H].

    The order [z, xBC, dt] is the one of mamba_ssm and transformers.
    """
    if zxbcdt.shape[-1] != config.projection_size:
        raise ValueError(f"split_projection: last dim is {zxbcdt.shape[-1]}, "
                         f"expected d_inner + conv_dim + H = {config.projection_size}")
    return zxbcdt.split([config.intermediate_size, config.conv_dim, config.num_heads], dim=-1)


def split_xbc(xBC: Tensor, config: Mamba2Config) -> tuple[Tensor, Tensor, Tensor]:
    """Split the (post-conv) xBC [b, T, conv_dim] into x [b, T, H, P], B [b, T, G, N], C [b, T, G, N]."""
    if xBC.shape[-1] != config.conv_dim:
        raise ValueError(f"split_xbc: last dim is {xBC.shape[-1]}, expected conv_dim = {config.conv_dim}")
    gn = config.n_groups * config.state_size
    x, B, C = xBC.split([config.intermediate_size, gn, gn], dim=-1)
    lead = xBC.shape[:-1]
    return (
        x.reshape(*lead, config.num_heads, config.head_dim),
        B.reshape(*lead, config.n_groups, config.state_size),
        C.reshape(*lead, config.n_groups, config.state_size),
    )


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
        self.act = ACTIVATIONS[cfg.hidden_act]
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
    def layer_name(self) -> str:
        """How errors name this layer: "Mamba2Mixer" or "Mamba2Mixer layer 3"."""
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
            name=f"{self.layer_name}, incoming state", check_finite=self.check_finite,
        )

    def _outgoing(self, state: Mamba2State) -> Mamba2State:
        if self.check_finite:
            check_state(state, name=f"{self.layer_name}, state produced from this input "
                                    "(NaN/inf in the input or weights?)")
        return state

    def scan_inputs(
        self, hidden_states: Tensor, state: Mamba2State | None = None, attention_mask: Tensor | None = None
    ) -> Mamba2ScanInputs:
        """Everything before the SSM scan: in_proj, split, causal conv (from state.conv), activation, discretize.

        hidden_states [b, T, D], state (only state.conv and the ssm dtype are used; None = zeros),
        attention_mask [b, T] or None. Returns a `Mamba2ScanInputs` (x, B, C, dt, A, D in the scan dtype).
        """
        cfg = self.config
        if state is None:
            state = self.init_state(hidden_states.shape[0], dtype=hidden_states.dtype, device=hidden_states.device)
        mask = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != tuple(hidden_states.shape[:2]):
                raise ValueError(f"{self.layer_name}: attention_mask must be [b, T] = "
                                 f"{tuple(hidden_states.shape[:2])}, got {tuple(attention_mask.shape)}")
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
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != cfg.hidden_size:
            raise ValueError(f"{self.layer_name}.forward: hidden_states must be [b, T, {cfg.hidden_size}], "
                             f"got {tuple(hidden_states.shape)}")
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
        if u.dim() != 3 or u.shape[1] != 1 or u.shape[-1] != cfg.hidden_size:
            raise ValueError(f"{self.layer_name}.step: hidden_state must be [b, {cfg.hidden_size}] or "
                             f"[b, 1, {cfg.hidden_size}], got {tuple(hidden_state.shape)}")
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
