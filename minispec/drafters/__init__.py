"""Drafters: anything that implements the protocol in `minispec.speculative.drafter`."""
from __future__ import annotations

from minispec.dflash.config import is_dflash_folder
from minispec.drafters.draft_lm import DraftLMDrafter
from minispec.drafters.ngram import NGramDrafter
from minispec.speculative.drafter import Drafter, Proposal, Sampling, check_num_draft_tokens

# Shipped draft models: name -> the command that builds its folder under minispec/checkpoints/.
DRAFT_MODELS = {"bolt-nano": "python -m minispec.targets.train bolt-nano --out minispec/checkpoints/bolt-nano",
                "bolt-mini-dflash": "python -m minispec.dflash.train --target bolt-mini --out minispec/checkpoints/"
                                    "bolt-mini-dflash, then python -m minispec.dflash.train --init-from "
                                    "minispec/checkpoints/bolt-mini-dflash --out minispec/checkpoints/bolt-mini-dflash "
                                    "--steps 700 --greedy-replies 2048 --num-anchors 96 --lr 1.5e-3 --work-dir "
                                    "~/.cache/minispec/train/bolt-mini-dflash-2",
                "smollm2-135m-dflash": "python -m minispec.dflash.train --target smollm2-135m --out "
                                       "minispec/checkpoints/smollm2-135m-dflash"}


def load_drafter(name_or_path, target, num_draft_tokens: int | None = None, policy: str | None = None):
    """A drafter for `target`: "ngram" (prompt lookup), "mtp" (the MTP head shipped beside the target's
    weights, e.g. lightning-mini's), a shipped drafter by name ("bolt-nano", "bolt-mini-dflash"), a local
    DFlash drafter folder, or a local HF causal-LM folder used as a draft model.

    policy: a DFlash drafter's drafting policy, "argmax" (its default) or "sample" (see
    `minispec.dflash.drafter`); other drafters have none.
    """
    from transformers import AutoModelForCausalLM

    from minispec.speculative.target import check_target
    from minispec.targets.load import resolve

    check_target(target)
    if num_draft_tokens is not None:
        check_num_draft_tokens(num_draft_tokens)
    kwargs = {} if num_draft_tokens is None else {"num_draft_tokens": num_draft_tokens}
    folder = None if name_or_path in ("ngram", "mtp") else resolve(name_or_path, DRAFT_MODELS, kind="drafter",
                                                                   also=["ngram", "mtp"])
    if folder is not None and is_dflash_folder(folder):
        from minispec.dflash.drafter import DFlashDrafter

        if policy is not None:
            kwargs["policy"] = policy
        return DFlashDrafter.from_pretrained(folder, target, **kwargs)
    if policy is not None:
        raise ValueError(f"policy={policy!r} is a DFlash drafter's drafting policy, and {str(name_or_path)!r} is not "
                         "a DFlash drafter")
    if name_or_path == "ngram":
        return NGramDrafter(target.config.vocab_size, **kwargs)
    if name_or_path == "mtp":
        from minispec.mtp.drafter import MTPDrafter

        return MTPDrafter.beside(target, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=target.dtype).eval()
    if model.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"drafter {str(name_or_path)!r} has vocab size {model.config.vocab_size} but the target "
                         f"has {target.config.vocab_size}: drafter and target must share one tokenizer")
    return DraftLMDrafter(model, **kwargs)


__all__ = ["DRAFT_MODELS", "DraftLMDrafter", "Drafter", "NGramDrafter", "Proposal", "Sampling", "load_drafter"]
