"""`Mamba2Config`: the shape and numerics of one Mamba-2 mixer, and its mapping to transformers' `NemotronHConfig`.

Sizes in the notation of the Mamba-2 paper (Dao & Gu 2024, "Transformers are SSMs"), per layer:

    D  hidden_size (model width)   H  heads       P  head_dim     N  state_size
    G  groups (heads h with h // (H/G) == g share B and C)
    K  conv_kernel                 Q  chunk_size  d_inner = H * P,  conv_dim = d_inner + 2 * G * N
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "Mamba2Config"]

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}  # the conv's activation, by name


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

    time_step_limit (time_step_limit): (lo, hi) clamp of dt = softplus(dt_raw + dt_bias), applied
    identically by the chunked and the step path, as transformers' NemotronH mixer (5.25 and later),
    vLLM and mamba_ssm apply it. Their default is (0, inf): no clamp.
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
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"Mamba2Config.hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
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
    def from_nemotron_h(cls, hf_config: Any) -> Mamba2Config:
        """Read the Mamba fields of a transformers `NemotronHConfig` (or any object with those attributes)."""
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
            time_step_limit=tuple(hf_config.time_step_limit),
            layer_norm_epsilon=float(hf_config.layer_norm_epsilon),
            time_step_min=float(hf_config.time_step_min),
            time_step_max=float(hf_config.time_step_max),
            time_step_floor=float(hf_config.time_step_floor),
        )

    def to_nemotron_h_kwargs(self) -> dict[str, Any]:
        """The `NemotronHConfig(**kwargs)` Mamba fields for this mixer.

        Round trip: `from_nemotron_h(NemotronHConfig(**kw))` gives back this config.
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
            "time_step_limit": list(self.time_step_limit),
        }
