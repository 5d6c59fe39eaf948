"""The boosting loop: train an MTP head against a frozen backbone on the backbone's own replies.

One step (the re-alignment of the Super/Lightning paper, "Nemotron 3.5 Super and Lightning: Open,
Efficient Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI", as Nebius re-trained
DeepSeek-V3's MTP module (model card nebius/MTP-DeepSeek-V3-0324): backbone frozen, its own T = 1
samples, KL to its distribution, with Megatron-LM's hidden-state mixing `mtp_hsm`):

    x, mask  = a seeded batch of replies (prompt ++ the backbone's reply; mask = 1 on reply tokens)
    loss     = boost_loss: per-depth KL(backbone ‖ head) on reply positions, averaged over depths, each
               depth reading the context `context` names: hidden-state mixing (draws from a generator
               seeded by (seed, step)), plain unrolling, or the stitched context drafting reads (TTT)

Only the head's weights reach the optimizer. The backbone, whose embedding and output head the head
shares, is checked against a snapshot at every checkpoint and at the end (`FrozenBackbone`): a run that
changed it stops with an error instead of shipping a head aligned to a backbone that no longer exists.
The loop is `minispec.training.train_loop`: resumable from `train_state.pt` in the work dir, checked
against the settings and against the weights digests of the backbone and of the head it started from.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from minispec import training
from minispec.mtp.backbone import Backbone
from minispec.mtp.boost import CONTEXTS, FrozenBackbone, boost_loss
from minispec.mtp.head import MTPHead
from minispec.targets.replies import Replies


@dataclass
class BoostSettings(training.Settings):
    lr: float = 1e-3
    depths: int = 3  # recursive calls trained per step
    context: str = "hsm"  # hidden-state mixing (Megatron-LM `mtp_hsm`), "unrolled" or "stitched" (boost.py)
    temperature: float = 1.0  # of both distributions in the KL
    objective: str = "kl"  # or "tv": train on 1 − Σ min(p, q), the acceptance itself

    def __post_init__(self):
        super().__post_init__()
        if self.context not in CONTEXTS:
            raise ValueError(f"context must be one of {CONTEXTS}, got {self.context!r}")
        if self.context == "hsm" and self.depths < 2:
            raise ValueError("hidden-state mixing needs depths >= 2 (depth 1 always reads the backbone)")


def make_optimizer(head: MTPHead, s: BoostSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(head.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)


def boost(head: MTPHead, backbone_model, replies: Replies, s: BoostSettings, work_dir: Path,
          stop_after: int | None = None, on_step=None, desc: str = "boost mtp") -> list[dict]:
    """Train `head` in place on `replies` against the frozen `backbone_model`; see the module doc.

    Resumes from `work_dir/train_state.pt`; `stop_after` ends the run early (with a checkpoint), as an
    interruption would. `on_step(step, record)` runs after every step (a notebook's live plot hooks in
    here). Returns the history: per step {"loss", "kl": [K], "acceptance": [K]} (acceptance = 1 − TV).
    """
    start = training.weights_digest(head)
    backbone_model.eval()
    for p in backbone_model.parameters():
        p.requires_grad_(False)
    frozen = FrozenBackbone(backbone_model)
    backbone = Backbone.of(backbone_model)

    def batch_loss(step: int):
        x, loss_mask = replies.batch(s.batch, s.seed, step)
        generator = torch.Generator(x.device).manual_seed(s.seed * 1_000_003 + step)
        res = boost_loss(head, backbone, x, s.depths, loss_mask=loss_mask, context=s.context, generator=generator,
                         temperature=s.temperature, objective=s.objective)
        return res.loss, {"loss": res.loss.item(), "kl": res.kl.tolist(), "acceptance": res.acceptance.tolist()}

    return training.train_loop({"model": head}, make_optimizer(head, s), s, batch_loss,
                               Path(work_dir) / "train_state.pt", stop_after=stop_after, on_step=on_step, desc=desc,
                               before_save=frozen.check,
                               must_match={"backbone": training.weights_digest(backbone_model), "start": start})
