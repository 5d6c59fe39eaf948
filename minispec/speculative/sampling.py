"""Temperature, top-k and top-p: the distribution a decoder draws its next token from.

Every decoder in minispec (autoregressive decoding, speculative verification, the drafters) turns
logits into probabilities here, so target and drafter always mean the same thing by "temperature
0.7, top-p 0.9". Exact speculative sampling needs that: the rejection step preserves exactly the
distribution `sampling_probs` returns.

The order is temperature -> top-k -> top-p, as in Hugging Face's `generate` and in vLLM:
  1. temperature reshapes the distribution, z = (logits - max logit) / temperature. Subtracting the
     row's largest logit first changes nothing in the softmax, and makes the largest z exactly 0 and
     every other z <= 0: logits / T alone overflows float32 to +inf (and the softmax to NaN) once
     T is tiny (logit 10 at T = 1e-38). Any temperature from float32's smallest normal number
     (MIN_TEMPERATURE, 1.2e-38) up is then safe; below it T itself may be flushed to 0 (on GPUs,
     and when torch converts it to float32), so smaller positive temperatures are refused;
  2. top-k keeps the k largest z. Dividing by a positive temperature keeps the order, so top-k keeps
     the same tokens before or after it;
  3. top-p keeps the most likely tokens up to mass top_p of softmax(z) over the top-k survivors. This
     mass does depend on the temperature and on the cut already made, so top-p comes last: the
     nucleus is taken from the very distribution that is sampled.
top_k >= V keeps every token, and top_p = 1 is skipped as Hugging Face skips it: otherwise float
rounding could let the mass above a very unlikely token reach 1.0 and cut it.

The Triton kernel beside this reference (kernels/sampling.py) finds the same kept sets without
sorting; `MINISPEC_BACKEND` picks between them (minispec/backend.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch
import torch.nn.functional as F

from minispec.backend import dispatch

MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # the smallest positive temperature (see step 1 above)


def check_sampling_args(temperature: float, top_k: int | None = None, top_p: float | None = None) -> None:
    """Raise TypeError for a wrong type, ValueError for a bad value, naming the argument: temperature 0
    (greedy) or finite and >= MIN_TEMPERATURE, top_k an int >= 1, top_p in (0, 1]. A bool is not a number here."""
    if isinstance(temperature, bool) or not isinstance(temperature, Real):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__} {temperature!r}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature!r}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.8g}, float32's smallest "
                         f"normal number (logits are divided by it in float32), got {temperature!r}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, Integral):
            raise TypeError(f"top_k must be an int >= 1 or None, got {type(top_k).__name__} {top_k!r}")
        if top_k < 1:
            raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, Real):
            raise TypeError(f"top_p must be a number in (0, 1] or None, got {type(top_p).__name__} {top_p!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def check_logits(logits: torch.Tensor) -> None:
    """Raise ValueError unless logits are usable: no NaN or +inf, and a finite value in every row.

    -inf is allowed: it is how a token is masked out.
    """
    # One reduction finds all three: a row's max is NaN if it holds a NaN (max propagates it), +inf if it holds
    # +inf, and -inf only if every entry is -inf. The decode loops call this on every forward's logits.
    row_max = logits.amax(dim=-1)
    if row_max.isnan().any() or row_max.isposinf().any():
        raise ValueError("non-finite logits: found NaN or +inf")
    if row_max.isneginf().any():
        raise ValueError("non-finite logits: a row is -inf everywhere, so no token can be drawn")


def top_k_mask(z: torch.Tensor, k: int) -> torch.Tensor:
    """Which tokens survive top-k: z >= the k-th largest z of the row (ties at the boundary survive).

    z: [..., V] float. Returns bool [..., V]. k >= V keeps every token.
    """
    kth_largest = z.topk(min(k, z.shape[-1]), dim=-1).values[..., -1:]
    return z >= kth_largest


def top_p_mask(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens survive top-p: token i survives iff the mass of tokens strictly more likely than i
    is < top_p.

    p: [..., V] probabilities. Returns bool [..., V].
    On distinct probabilities this is Hugging Face's rule (sort, cumulate, cut the tail of mass
    <= 1 - top_p). It also treats equally likely tokens alike, always keeps the most likely token
    (nothing is above it), and needs no sort, which is what lets the kernel avoid one. The reference
    sorts anyway because that is the shortest way to compute it here.
    The masses are float64 sums compared with top_p in float64: a float32 sum near 1 rounds by up to 6e-8,
    as much as a tail token weighs, and would keep or cut it by accident (torch's CUDA cumsum also sums
    float32 in float32).
    """
    descending = p.sort(dim=-1, descending=True).values
    mass_before = F.pad(descending.double().cumsum(dim=-1)[..., :-1], (1, 0))  # mass ranked above each position
    n_above = torch.searchsorted(-descending, -p)  # number of tokens strictly more likely than each token
    return mass_before.gather(-1, n_above) < top_p


@dispatch("sampling:sampling_probs")
def sampling_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The probabilities the next token is drawn from.

    logits: [..., V], any float dtype. Returns float32 [..., V]; every row sums to 1.
    Temperature 0 puts all the mass on the argmax (the first one on ties) and ignores top_k and top_p.
    """
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        return F.one_hot(greedy(logits), logits.shape[-1]).float()
    check_logits(logits)

    z = logits.float()
    z = (z - z.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None:
        z = z.masked_fill(~top_k_mask(z, top_k), -math.inf)
    p = z.softmax(dim=-1, dtype=torch.float64).float()  # float32's own softmax sums its denominator in float32
    if top_p is not None and top_p < 1:
        p = p.masked_fill(~top_p_mask(p, top_p), 0.0)
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row drawn from probs [..., V]. Returns LongTensor [...]."""
    rows = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(rows, 1, generator=generator).reshape(probs.shape[:-1])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The most likely token (the first one on ties). logits [..., V] -> LongTensor [...]."""
    check_logits(logits)
    # On a CPU, argmax over bfloat16 runs ~4x slower than converting to float32 first (exact) and taking it there.
    return logits.float().argmax(dim=-1)


def next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token for each row of logits [..., V] -> LongTensor [...].

    Temperature 0 is greedy and draws no random numbers, so it leaves `generator` untouched.
    """
    check_sampling_args(temperature, top_k, top_p)
    if temperature == 0:
        return greedy(logits)
    return sample(sampling_probs(logits, temperature, top_k, top_p), generator)


@dataclass(frozen=True)
class Sampling:
    """Temperature / top-k / top-p: the one form the settings travel in, applied identically to the target's
    and the drafts' distributions."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        check_sampling_args(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """`sampling_probs` under these settings: [..., V] logits -> [..., V] probabilities."""
        return sampling_probs(logits, self.temperature, self.top_k, self.top_p)

    def next_token(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """`next_token` under these settings: [B, V] logits -> [B] token ids."""
        return next_token(logits, self.temperature, self.top_k, self.top_p, generator)
