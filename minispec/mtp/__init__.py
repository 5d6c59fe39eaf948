"""Multi-token prediction: a Nemotron/DeepSeek-style MTP head that drafts by calling itself K times.

    head = MTPHead(MTPConfig.like(target.config))          # weights named mtp.* as in Nemotron-H
    drafter = MTPDrafter(head, target, num_draft_tokens=3)
    ms.speculative_generate(target, drafter, prompts, 64)
"""
from minispec.mtp.backbone import Backbone, check_head_fits
from minispec.mtp.drafter import MTPDrafter
from minispec.mtp.head import MTPCache, MTPConfig, MTPHead, StitchedContext

__all__ = ["Backbone", "MTPCache", "MTPConfig", "MTPDrafter", "MTPHead", "StitchedContext", "check_head_fits"]
