"""The boosting loop: train an MTP head against a frozen backbone on the backbone's own replies.

One step (research/mtp_edu.md §1.3, §5.5):

    x, mask  = a seeded batch of replies (prompt ++ the backbone's reply; mask = 1 on reply tokens)
    loss     = boost_loss: per-depth KL(backbone ‖ head) on reply positions, averaged over depths,
               optionally with hidden-state mixing (draws from a generator seeded by (seed, step))

Only the head's weights reach the optimizer. The backbone, whose embedding and output head the head
shares, is checked against a snapshot at every checkpoint and at the end (`FrozenBackbone`): a run that
changed it stops with an error instead of shipping a head aligned to a backbone that no longer exists.
Resumable like `minispec.dflash.train`: `train_state.pt` in the work dir, checked against the settings
and against the backbone's weights digest.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from minispec import resume
from minispec.mtp.backbone import Backbone
from minispec.mtp.boost import FrozenBackbone, boost_loss
from minispec.mtp.head import MTPHead
from minispec.targets.replies import Replies, weights_digest
from minispec.targets.train import lr_at


@dataclass
class BoostSettings:
    steps: int = 300
    batch: int = 8
    depths: int = 3  # recursive calls trained per step
    hsm: bool = True  # hidden-state mixing (Megatron-LM `mtp_hsm`)
    temperature: float = 1.0  # of both distributions in the KL
    objective: str = "kl"  # or "tv": train on 1 − Σ min(p, q), the acceptance itself
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 50


def make_optimizer(head: MTPHead, s: BoostSettings) -> torch.optim.AdamW:
    return torch.optim.AdamW(head.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=s.weight_decay)


def _load_state(path: Path, head: MTPHead, opt, s: BoostSettings, backbone_digest: str) -> tuple[int, list[dict]]:
    previous = resume.stored(path, "backbone")
    if previous is not None and previous != backbone_digest:
        raise ValueError(f"{path} was boosted against another backbone (weights digest {previous}, "
                         f"this one is {backbone_digest}); delete it or resume with the same backbone")
    return resume.load(path, {"model": head, "optimizer": opt}, asdict(s))


def boost(head: MTPHead, backbone_model, replies: Replies, s: BoostSettings, work_dir: Path,
          stop_after: int | None = None, on_step=None, desc: str = "boost mtp") -> list[dict]:
    """Train `head` in place on `replies` against the frozen `backbone_model`; see the module doc.

    Resumes from `work_dir/train_state.pt`; `stop_after` ends the run early (with a checkpoint), as an
    interruption would. `on_step(step, record)` runs after every step (a notebook's live plot hooks in
    here). Returns the history: per step {"loss", "kl": [K], "acceptance": [K]} (acceptance = 1 − TV).
    """
    backbone_model.eval()
    for p in backbone_model.parameters():
        p.requires_grad_(False)
    frozen = FrozenBackbone(backbone_model)
    digest = weights_digest(backbone_model)
    backbone = Backbone.of(backbone_model)
    opt = make_optimizer(head, s)
    ckpt = Path(work_dir) / "train_state.pt"
    start, history = _load_state(ckpt, head, opt, s, digest)
    end = s.steps if stop_after is None else min(s.steps, stop_after)
    head.train()
    bar = tqdm(range(start, end), initial=start, total=s.steps, desc=desc)
    for step in bar:
        x, loss_mask = replies.batch(s.batch, s.seed, step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        generator = torch.Generator(x.device).manual_seed(s.seed * 1_000_003 + step)
        res = boost_loss(head, backbone, x, s.depths, loss_mask=loss_mask, hsm=s.hsm, generator=generator,
                         temperature=s.temperature, objective=s.objective)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), s.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append({"loss": res.loss.item(), "kl": res.kl.tolist(), "acceptance": res.acceptance.tolist()})
        if on_step is not None:
            on_step(step, history[-1])
            head.train()
        bar.set_postfix(loss=f"{history[-1]['loss']:.4f}", acc1=f"{history[-1]['acceptance'][0]:.3f}")
        if (step + 1) % s.ckpt_every == 0 or step + 1 == end:
            frozen.check()
            resume.save(ckpt, {"model": head, "optimizer": opt}, step + 1, history, asdict(s), backbone=digest)
    head.eval()
    return history
