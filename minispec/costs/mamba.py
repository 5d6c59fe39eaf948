"""Mamba-2 state and replay-record sizes, from a `Mamba2Config`: what checkpoint + replay saves.

Sizes per layer and sequence, in the Mamba-2 paper's names (H heads of dim P, state size N, G groups of
B and C, conv kernel K); a model's total is its number of Mamba layers times these.
"""

from __future__ import annotations

from dataclasses import dataclass

from minispec.costs.checkpoints import SUPER_SHAPE
from minispec.costs.units import BF16_BYTES, check_positive, check_positive_int
from minispec.ssm.config import Mamba2Config
from minispec.targets.configs import lightning_mini_config

# Nemotron 3 Super 120B: H=128, P=64, N=128, G=8 on 40 of its 88 layers (`SUPER_SHAPE`, from its config.json).
SUPER_MAMBA2 = SUPER_SHAPE.mamba_config()
SUPER_MAMBA_LAYERS = SUPER_SHAPE.pattern.count("M")
# lightning-mini (minispec's Nemotron-H hybrid): H=8, P=32, N=32, G=2 on 4 of its 8 layers.
LIGHTNING_MINI_MAMBA2 = Mamba2Config.from_nemotron_h(lightning_mini_config())
LIGHTNING_MINI_MAMBA_LAYERS = lightning_mini_config().hybrid_override_pattern.count("M")


def mamba_state_bytes(shape: Mamba2Config, bytes_per_element: float = 4) -> float:
    """SSM state of one layer and sequence: H · P · N · bytes (fp32 by default).

    Super: 128 · 64 · 128 · 4 B = 4 MiB per layer (the conv state is separate and not counted).
    """
    check_positive(bytes_per_element=bytes_per_element)
    return shape.num_heads * shape.head_dim * shape.state_size * bytes_per_element


def replay_record_bytes(shape: Mamba2Config, x_bytes: float = BF16_BYTES, dt_bytes: float = 4) -> float:
    """One checkpoint + replay record per token and layer: x (H·P) and B (G·N) in bf16, dt (H) in fp32
    (the record of ReplaySSM, Dao AI Lab: Johnny-Liou/ReplaySSM).

    Super: (8192 + 1024) · 2 + 128 · 4 = 18,944 B, 0.45 % of the 4 MiB state: replaying from a
    checkpoint stores a record per draft position instead of a whole state.
    """
    check_positive(x_bytes=x_bytes, dt_bytes=dt_bytes)
    x_and_b = shape.num_heads * shape.head_dim + shape.n_groups * shape.state_size
    return x_and_b * x_bytes + shape.num_heads * dt_bytes


def native_spec_state_writes_bytes(
    shape: Mamba2Config, num_tokens: int, bytes_per_element: float = 4
) -> float:
    """State traffic of one verify step when every position's state is written (vLLM native).

    Reads the state once and writes it T times: (1 + T) · S per layer. Super, T = 4: 20 MiB;
    plain decode (T = 1) moves 8 MiB per token.
    """
    check_positive_int(num_tokens=num_tokens)
    return (1 + num_tokens) * mamba_state_bytes(shape, bytes_per_element)


@dataclass(frozen=True)
class SpecStateTraffic:
    """Mamba state bytes per layer and sequence for one strategy, averaged over verify steps."""

    strategy: str
    window: int  # T = drafts + 1
    committed_per_step: int  # accepted drafts + the bonus/correction token
    read_per_step: float
    written_per_step: float
    memory_per_request: float  # state + ring (replay) or T states (per-position), conv windows included

    @property
    def written_per_token(self) -> float:
        return self.written_per_step / self.committed_per_step

    @property
    def read_per_token(self) -> float:
        return self.read_per_step / self.committed_per_step


def spec_state_traffic(shape: Mamba2Config, window: int, committed_per_step: int, strategy: str,
                       capacity: int = 16, state_bytes: float = 4, act_bytes: float = BF16_BYTES,
                       steps: int = 1000) -> SpecStateTraffic:
    """The byte model `minispec.ssm.replay`'s stores count, for any shape.

    State = SSM state (H·P·N · state_bytes) + conv window ((K-1) · conv_dim · act_bytes),
    conv_dim = H·P + 2·G·N. A record = x (H·P), B (G·N), dt (H, state_bytes), and the pre-conv column
    (conv_dim) that rebuilds the conv window on rollback.
      per-position: each verify step reads 1 state and writes T.
      replay:       each verify step reads the checkpoint, the committed records (x, B, dt) and the conv
                    window, and writes T records; when count + T > capacity the committed records are
                    first folded (flush: read checkpoint + records, write the checkpoint once).
    Every step keeps `committed_per_step` tokens; averaged over `steps` steps from an empty ring.
    """
    check_positive_int(window=window, committed_per_step=committed_per_step, capacity=capacity, steps=steps)
    if committed_per_step > window:
        raise ValueError(f"committed_per_step ({committed_per_step}) cannot exceed the window T ({window})")
    if strategy not in ("per-position", "replay"):
        raise ValueError(f"strategy must be 'per-position' or 'replay', got {strategy!r}")
    if strategy == "replay" and window > capacity:
        raise ValueError(f"a window of {window} tokens does not fit a ring of {capacity} records")
    ssm = mamba_state_bytes(shape, state_bytes)
    conv_dim = shape.conv_dim
    conv = (shape.conv_kernel - 1) * conv_dim * act_bytes
    replay_part = ((shape.num_heads * shape.head_dim + shape.n_groups * shape.state_size) * act_bytes
                   + shape.num_heads * state_bytes)
    record = replay_part + conv_dim * act_bytes
    if strategy == "per-position":
        return SpecStateTraffic(strategy, window, committed_per_step, ssm + conv, window * (ssm + conv),
                                window * (ssm + conv))
    read = written = 0.0
    count = 0
    for _ in range(steps):
        if count + window > capacity:
            read += ssm + count * replay_part
            written += ssm
            count = 0
        read += ssm + count * replay_part + conv
        written += window * record
        count += committed_per_step
    return SpecStateTraffic(strategy, window, committed_per_step, read / steps, written / steps,
                            ssm + conv + capacity * record)
