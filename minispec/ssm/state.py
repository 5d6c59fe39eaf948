"""The recurrent state of one Mamba-2 layer (`Mamba2State`), its checks, and transformers' conv layout.

State layout, one per layer and sequence (sizes as in `minispec.ssm.config`):

    conv  [b, conv_dim, K-1]   the last K-1 *pre-conv* xBC columns, oldest first (the newest is [..., -1]).
                               This is the minimal rolling window (vLLM's layout). transformers keeps K columns
                               (one more, never read); `conv_state_to_hf` / `conv_state_from_hf` convert.
    ssm   [b, H, P, N]         h, in float32 (or float64 when the activations are float64): `state_dtype`.

A poisoned state is reported where it is first seen (`check_state`) instead of silently spreading
through the recurrence: once h holds a NaN, every later output of that sequence is NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minispec.ssm.config import Mamba2Config

__all__ = ["Mamba2State", "Mamba2StateError", "check_state", "state_dtype", "conv_state_to_hf", "conv_state_from_hf"]


class Mamba2StateError(ValueError):
    """A Mamba-2 state has the wrong shape or holds NaN/inf values."""


def state_dtype(activation_dtype: torch.dtype) -> torch.dtype:
    """The SSM state (and the scan) run in float32, or in float64 for float64 activations."""
    return torch.promote_types(activation_dtype, torch.float32)


@dataclass
class Mamba2State:
    """The recurrent state of one Mamba-2 layer for a batch of sequences.

    conv: [b, conv_dim, K-1]  last K-1 pre-conv xBC inputs, oldest first, activation dtype.
    ssm:  [b, H, P, N]        the SSM state h, `state_dtype` of the activations.

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
    ) -> Mamba2State:
        """The state before any token. `dtype` is the activation dtype; the ssm part uses `state_dtype`."""
        conv = torch.zeros(batch_size, config.conv_dim, config.conv_kernel - 1, dtype=dtype, device=device)
        ssm = torch.zeros(
            batch_size, config.num_heads, config.head_dim, config.state_size, dtype=state_dtype(dtype), device=device
        )
        return cls(conv=conv, ssm=ssm)

    @property
    def batch_size(self) -> int:
        return self.ssm.shape[0]

    def clone(self) -> Mamba2State:
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

    `name` goes into the message (the mixer passes e.g. "Mamba2Mixer layer 3, incoming state").
    Returns `state`.
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
