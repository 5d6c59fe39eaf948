"""MTP boosting: re-align a stale MTP head to a frozen backbone by distilling its whole distribution.

Slot indexing (the same as the drafter's): slot j pairs a hidden state standing in for the backbone's
h_j with the token x_{j+1}, and predicts x_{j+2}, at every depth. Depth 1 reads the backbone's h_j.
Depth k reads, at slot j, the output of depth k-1 at slot j-1, which is the head's own stand-in for
h_j; so the teacher of every depth at slot j is the backbone's distribution at position j+1:

    loss = mean over depths k of  mean over counted slots j of  KL(p_backbone(· | x_≤j+1) ‖ q_k,j)

Slot j counts at depth k when j >= k-1 (the chain of stand-ins reaches back to a backbone hidden state
at slot j-k+1 >= 0), both tokens exist, and `loss_mask` marks position j+1 (e.g. reply tokens only).

Hidden-state mixing (Megatron-LM's `mtp_hsm`): at depth k each slot draws its input uniformly from the
k candidates that all stand in for h_j: the backbone's h_j and the outputs of depths 1..k-1 at slot
j-1 (rolled by one so every candidate predicts the same token). A candidate from before the first slot,
or from a padding slot, does not exist; that slot falls back to the backbone's h_j, the entry that is
always present here. (Megatron-LM indexes each depth by its own position, rolls the *older* entries
instead and falls back to the newest where a rolled one is zero; either way the fallback only touches
slots the loss does not count, j < k-1, or slots right after padding.) The draws come from the
caller's generator, so a run is reproducible.

The Super/Lightning paper says only that step k's input hidden states are sampled from those of steps
1..k-1. Drawing per slot and uniformly, with the backbone's h_j among the candidates, is how Megatron-LM's
`mtp_hsm` does it and this project's choice; so are a KL term at every trained depth and a teacher computed
on the real prefix (the paper does not say how it sets the teacher past the first step).

Three contexts, `context=`:

    "unrolled"  depth k takes depth k-1's output, at every slot. Its input hidden state is the drafter's,
                but its attention is not: the keys at the other slots are also depth k's, built from the
                head's own stand-ins, where the drafter's cache holds depth-1 entries of the verified prefix.
                Measured on the shipped lightning-mini-post head over every cycle start of an eval-set
                prompt: depth 1 agrees with drafting to float rounding, depths 2-4 differ from it by max
                |Δlogit| 0.47-0.68 and a mean TV of 2.3-2.7% (up to 5.7%).
    "hsm"       hidden-state mixing (above): cheap, and deliberately not what drafting feeds.
    "stitched"  test-time training (EAGLE-3's training-time test): each depth k of every chain c (a cycle
                that starts at slot c) attends to what the drafter's cache holds when it drafts depth k,
                the depth-1 entries of slots <= c and this chain's own depths 2..k
                (`minispec.mtp.head.StitchedContext`). Its logits are the drafter's, for every depth and
                every cycle start, up to float rounding (tests/test_mtp_boost.py).

1 − TV(p, q) = Σ_v min(p_v, q_v) is the probability that a draft sampled from q is accepted against p
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"): the number
acceptance pays for, reported per depth beside the KL.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from minispec.kl import kl_divergence
from minispec.mtp.backbone import Backbone, check_head_fits
from minispec.mtp.head import MTPHead, StitchedContext

OBJECTIVES = ("kl", "tv")
CONTEXTS = ("unrolled", "hsm", "stitched")


@dataclass
class BoostLoss:
    loss: Tensor  # 0-d, mean over depths of the per-depth KL (differentiable in the head)
    kl: Tensor  # [K] per-depth KL (detached)
    acceptance: Tensor  # [K] per-depth mean of 1 − TV(p_backbone, q_head) (detached)
    counted: Tensor  # [K] slots counted per depth


def roll_right(x: Tensor, n: int = 1) -> Tensor:
    """x [B, S, ...] -> y with y[:, j] = x[:, j-n]; y[:, :n] is zeros (and must not be used)."""
    if n == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :n]), x[:, :-n]], dim=1)


def roll_left(x: Tensor, n: int) -> Tensor:
    """x [B, S, ...] -> y with y[:, c] = x[:, c+n]; the last n are zeros."""
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)


def mix_hidden_states(history: list[Tensor], slot_valid: Tensor, generator: torch.Generator | None) -> Tensor:
    """Hidden-state mixing for depth k = len(history).

    history: [backbone h [B, S, H], out_1, ..., out_{k-1}] with out_m [B, S, H] at its own slots.
    slot_valid [B, S]. Returns the input hidden state of depth k [B, S, H]: per slot, one candidate
    drawn uniformly from {h_j, out_1[j-1], ..., out_{k-1}[j-1]}; h_j where the rolled ones do not exist.
    """
    h = history[0]
    B, S, _ = h.shape
    k = len(history)
    candidates = torch.stack([h] + [roll_right(o) for o in history[1:]], dim=0)  # [k, B, S, H]
    choice = torch.randint(0, k, (B, S), generator=generator, device=h.device)
    has_previous = roll_right(slot_valid[..., None])[..., 0]  # slot j-1 exists and is real
    choice = torch.where(has_previous, choice, torch.zeros_like(choice))
    index = choice[None, :, :, None].expand(1, B, S, h.shape[-1])
    return candidates.gather(0, index)[0]


def chained_hidden_state(history: list[Tensor], slot_valid: Tensor) -> Tensor:
    """Depth k's input without mixing: depth k-1's output at slot j-1 (the backbone's h_j at depth 1)."""
    if len(history) == 1:
        return history[0]
    has_previous = roll_right(slot_valid[..., None])
    return torch.where(has_previous, roll_right(history[-1]), history[0])


def run_depths(head: MTPHead, backbone: Backbone, hidden: Tensor, input_ids: Tensor, depths: int,
               attention_mask: Tensor | None = None, context: str = "unrolled",
               generator: torch.Generator | None = None, shared_grad: bool = False) -> list[Tensor]:
    """The head's K depths over whole sequences: hidden [B, S, H] (backbone, after its final norm),
    input_ids [B, S] -> K logits [B, S, V] (float32), slot j of each predicting x_{j+2}.

    context: "unrolled", "hsm" (draws from `generator`) or "stitched" (see the module doc).
    shared_grad=False (boosting): the embedding and output head the head shares with the backbone are
    constants, so gradients train the head's own weights only. True: joint training updates them too.
    """
    return _run_depths(head, backbone, hidden, input_ids, depths, attention_mask, context, generator, shared_grad)[0]


def _run_depths(head, backbone, hidden, input_ids, depths, attention_mask, context, generator, shared_grad):
    """run_depths, also returning the inputs each depth read ([K] of [B, S, H], at slots) and the slot mask."""
    if not isinstance(depths, int) or depths < 1:
        raise ValueError(f"depths must be an int >= 1, got {depths!r}")
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {CONTEXTS}, got {context!r}")
    if context == "hsm" and depths < 2:
        raise ValueError("hidden-state mixing needs at least 2 depths (depth 1 always reads the backbone)")
    B, S = input_ids.shape
    real = (torch.ones(B, S, dtype=torch.bool, device=input_ids.device) if attention_mask is None
            else attention_mask.bool())
    slot_valid = real & torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)  # x_j and x_{j+1} real
    if context == "stitched":
        return (*_stitched_depths(head, backbone, hidden, input_ids, depths, real, slot_valid, shared_grad),
                slot_valid)
    next_ids = roll_left(input_ids, 1).masked_fill(~slot_valid, 0)
    with torch.set_grad_enabled(shared_grad and torch.is_grad_enabled()):
        next_embeds = backbone.embed(next_ids)
    history, logits, inputs = [hidden], [], []
    for _ in range(depths):
        h_in = (mix_hidden_states(history, slot_valid, generator) if context == "hsm"
                else chained_hidden_state(history, slot_valid))
        out = head(h_in, next_embeds, slot_valid)
        inputs.append(h_in)
        history.append(out)
        logits.append(backbone.logits(out, shared_grad))
    return logits, inputs, slot_valid


def _stitched_depths(head, backbone, hidden, input_ids, depths, real, chain_valid, shared_grad):
    """Test-time training: every depth of every chain c (the cycle that starts with the backbone's h_c) in
    the context the drafter gives it. Depth k of chain c reads depth k-1's output of the same chain and the
    token x_{c+k}, and predicts x_{c+k+1}; it runs at slot c+k-1, so its logits are rolled right by k-1
    into slot indexing. Returns (K logits [B, S, V], K inputs [B, S, H]), both at slots."""
    context = StitchedContext(chain_valid)
    h, logits, inputs = hidden, [], []
    for k in range(1, depths + 1):
        valid = chain_valid & roll_left(real, k)  # x_c .. x_{c+k} real
        with torch.set_grad_enabled(shared_grad and torch.is_grad_enabled()):
            embeds = backbone.embed(roll_left(input_ids, k).masked_fill(~valid, 0))
        out = head(h, embeds, valid, context)
        inputs.append(roll_right(h, k - 1))
        logits.append(roll_right(backbone.logits(out, shared_grad), k - 1))
        h = out
    return logits, inputs


@torch.no_grad()
def stand_in_gap(head: MTPHead, backbone: Backbone, input_ids: Tensor, depths: int) -> dict[str, Tensor]:
    """The train/inference mismatch, measured on input_ids [B, S]: at depth k the head reads its own
    output in place of the backbone's h_j, as it does when drafting (the stitched context). Per depth
    k = 1..K, over slots j >= k-1: "cosine" [K] mean cosine similarity and "relative_error" [K] mean
    ‖stand-in − h_j‖ / ‖h_j‖ (depth 1 reads h_j itself: 1 and 0)."""
    _, hidden = backbone.run(input_ids)
    _, inputs, slot_valid = _run_depths(head, backbone, hidden, input_ids, depths, None, "stitched", None, False)
    slots = torch.arange(input_ids.shape[1], device=input_ids.device)
    cosines, errors = [], []
    for k, h_in in enumerate(inputs, start=1):
        mask = slot_valid & (slots >= k - 1)[None, :]
        h, x = hidden.float(), h_in.float()
        cos = torch.nn.functional.cosine_similarity(x, h, dim=-1)
        err = (x - h).norm(dim=-1) / h.norm(dim=-1).clamp(min=1e-12)
        cosines.append(cos[mask].mean())
        errors.append(err[mask].mean())
    return {"cosine": torch.stack(cosines), "relative_error": torch.stack(errors)}


def boost_loss(head: MTPHead, backbone: Backbone, input_ids: Tensor, depths: int,
               loss_mask: Tensor | None = None, attention_mask: Tensor | None = None, context: str = "unrolled",
               generator: torch.Generator | None = None, temperature: float = 1.0,
               objective: str = "kl") -> BoostLoss:
    """Per-depth KL(backbone ‖ head) on input_ids [B, S]; the backbone runs without gradients.

    context: what each depth reads, "unrolled", "hsm" or "stitched" (module doc); with "stitched", the
    per-depth 1 − TV is the acceptance rate of a sampled draft at that depth when the drafts before it
    were the data's tokens.
    loss_mask [B, S]: 1 where position p's next-token distribution counts (default: everywhere real).
    objective="tv" trains on TV(p, q) = 1 − Σ min(p, q) instead, the acceptance loss itself (the
    "LK losses" of Samarin et al. 2026, arXiv 2602.23881); `kl` and `acceptance` are reported either way.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    check_head_fits(head, backbone)
    B, S = input_ids.shape
    if S < 3:
        raise ValueError(f"boosting needs sequences of >= 3 tokens (slot j predicts x_(j+2)), got {S}")
    for name, m in (("loss_mask", loss_mask), ("attention_mask", attention_mask)):
        if m is not None and m.shape != input_ids.shape:
            raise ValueError(f"{name} {tuple(m.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    with torch.no_grad():
        teacher, hidden = backbone.run(input_ids, attention_mask)
    student = run_depths(head, backbone, hidden, input_ids, depths, attention_mask, context, generator)
    real = (torch.ones(B, S, dtype=torch.bool, device=input_ids.device) if attention_mask is None
            else attention_mask.bool())
    counts = real if loss_mask is None else real & loss_mask.bool()
    teacher_next = teacher[:, 1:]  # slot j's teacher: the backbone at position j+1
    slots = torch.arange(S - 1, device=input_ids.device)
    kls, accepts, counted, terms = [], [], [], []
    for k, logits in enumerate(student, start=1):
        mask = counts[:, 1:] & real[:, :-1] & (slots >= k - 1)[None, :]  # [B, S-1]
        kl = kl_divergence(teacher_next, logits[:, :-1], temperature, "none")
        n = mask.sum().clamp(min=1)
        kl_term = (kl * mask).sum() / n
        p = torch.softmax(teacher_next / temperature, -1)
        student = logits[:, :-1] if objective == "tv" else logits[:, :-1].detach()
        q = torch.softmax(student / temperature, -1)
        accept = (torch.minimum(p, q).sum(-1) * mask).sum() / n
        terms.append(kl_term if objective == "kl" else 1 - accept)
        accepts.append(accept.detach())
        kls.append(kl_term.detach())
        counted.append(mask.sum())
    return BoostLoss(torch.stack(terms).mean(), torch.stack(kls), torch.stack(accepts), torch.stack(counted))


class FrozenBackbone:
    """Boosting trains the head against a *fixed* backbone: remember its weights, refuse any change.

    check() raises ValueError naming the first parameters or buffers that differ from the snapshot
    (an optimizer that was handed the backbone's parameters, a forgotten requires_grad, a stray load).
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def check(self) -> None:
        state = self.model.state_dict()
        changed = [k for k, v in self.snapshot.items() if k not in state or not torch.equal(state[k], v)]
        if changed:
            raise ValueError(f"the backbone changed during boosting ({len(changed)} tensors, e.g. "
                             f"{', '.join(changed[:3])}); boosting needs it frozen: leave its parameters out "
                             "of the optimizer and set requires_grad=False")


@torch.no_grad()
def distribution_shift(old_model, new_model, input_ids: Tensor, loss_mask: Tensor | None = None) -> dict[str, float]:
    """How far a post-trained backbone moved from the one a head was trained on, per token on input_ids [B, S]:
    mean KL(p_new ‖ p_old) and mean 1 − TV(p_new, p_old) (the acceptance a perfect copy of the old
    backbone would get against the new one). loss_mask [B, S]: positions that count (default all)."""
    old_logits, _ = Backbone.of(old_model).run(input_ids)
    new_logits, _ = Backbone.of(new_model).run(input_ids)
    mask = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    n = mask.sum().clamp(min=1)
    kl = (kl_divergence(new_logits, old_logits, reduction="none") * mask).sum() / n
    overlap = torch.minimum(torch.softmax(new_logits, -1), torch.softmax(old_logits, -1)).sum(-1)
    return {"kl": float(kl), "one_minus_tv": float((overlap * mask).sum() / n)}
