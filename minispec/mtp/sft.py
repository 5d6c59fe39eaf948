"""The SFT-stage loss: backbone and MTP head trained together on data, as Megatron-LM trains MTP.

    loss = LM cross-entropy of the backbone  +  mtp_weight · mean over depths k of CE_k

CE_k is the head's cross-entropy at depth k against the data: slot j predicts x_{j+2} (slot indexing as
in boost.py: depth k reads depth k-1's output one slot back), counted for j >= k-1. Megatron-LM's
`mtp_loss_scaling_factor` defaults to 0.1, hence mtp_weight. Gradients reach the backbone through both
terms (through its hidden states and the shared embedding / output head) unless `detach_backbone`
(Megatron's `mtp_detach_heads`), which keeps the head's loss from moving the backbone's trunk.

Accuracy here is against the data's next tokens, as Megatron logs it; what serving pays for is
agreement with the backbone's own predictions (boost.py's 1 − TV, or the drafter's measured acceptance).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from minispec.mtp.backbone import Backbone, check_head_fits
from minispec.mtp.boost import run_depths
from minispec.mtp.head import MTPHead


@dataclass
class JointLoss:
    loss: Tensor  # 0-d, differentiable in backbone and head
    lm: Tensor  # backbone next-token CE (detached)
    mtp: Tensor  # [K] per-depth CE (detached)
    mtp_accuracy: Tensor  # [K] per-depth argmax accuracy against the data


def joint_loss(backbone_model, head: MTPHead, input_ids: Tensor, depths: int, mtp_weight: float = 0.1,
               loss_mask: Tensor | None = None, detach_backbone: bool = False) -> JointLoss:
    """input_ids [B, S]; loss_mask [B, S]: 1 where token x_p is a target (default everywhere)."""
    backbone = Backbone.of(backbone_model)
    check_head_fits(head, backbone)
    B, S = input_ids.shape
    if S < 3:
        raise ValueError(f"the MTP loss needs sequences of >= 3 tokens (slot j predicts x_(j+2)), got {S}")
    if loss_mask is not None and loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} must have input_ids' shape {tuple(input_ids.shape)}")
    target_ok = torch.ones_like(input_ids, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    logits, hidden = backbone.run(input_ids)
    lm_mask = target_ok[:, 1:]
    lm = (F.cross_entropy(logits[:, :-1].transpose(1, 2), input_ids[:, 1:], reduction="none") * lm_mask).sum()
    lm = lm / lm_mask.sum().clamp(min=1)
    if detach_backbone:
        hidden = hidden.detach()
    student = run_depths(head, backbone, hidden, input_ids, depths, shared_grad=not detach_backbone)
    slots = torch.arange(S - 2, device=input_ids.device)
    ces, accs = [], []
    for k, depth_logits in enumerate(student, start=1):
        mask = target_ok[:, 2:] & (slots >= k - 1)[None, :]  # [B, S-2]: slot j's target is x_{j+2}
        n = mask.sum().clamp(min=1)
        ce = F.cross_entropy(depth_logits[:, :-2].transpose(1, 2), input_ids[:, 2:], reduction="none")
        ces.append((ce * mask).sum() / n)
        accs.append(((depth_logits[:, :-2].argmax(-1) == input_ids[:, 2:]) & mask).sum() / n)
    mtp = torch.stack(ces)
    return JointLoss(lm + mtp_weight * mtp.mean(), lm.detach(), mtp.detach(), torch.stack(accs).detach())
