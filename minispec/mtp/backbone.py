"""What an MTP head needs from the model it drafts for, and nothing more.

    embed(ids [B, T]) -> [B, T, H]       the backbone's token embedding (shared with the head)
    logits(out [B, T, H]) -> [B, T, V]   the backbone's output head (shared), incl. any logit soft-cap
    hidden(target_out) -> [B, n, H]      the last hidden state, after the final norm, from the outputs
                                         the speculative loop already has (prefill / verify forwards)
    run(ids, mask) -> (logits, hidden)   one full forward, for training and evaluation

`Backbone.of(model)` builds it for minispec's `HybridLM` (lightning-mini) and for any Hugging Face
causal LM (a tiny `NemotronHForCausalLM` or Gemma in the tests).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minispec.speculative.output import TargetOutput


@dataclass
class Backbone:
    model: nn.Module
    embed: nn.Module
    head: nn.Module
    softcap: float | None
    hidden_size: int
    vocab_size: int
    forward_fn: Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor]]

    @classmethod
    def of(cls, model: nn.Module) -> Backbone:
        if hasattr(model, "get_input_embeddings") and hasattr(model, "get_output_embeddings"):
            cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config

            def run(ids, mask):
                out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                return out.logits.float(), out.hidden_states[-1]
            embed, head = model.get_input_embeddings(), model.get_output_embeddings()
            return cls(model, embed, head, getattr(cfg, "final_logit_softcapping", None),
                       embed.embedding_dim, head.out_features, run)
        # minispec.ssm.hybrid.HybridLM; checked second because some HF models have a `.backbone` attribute too.
        if hasattr(model, "backbone") and hasattr(model, "lm_head"):
            def run(ids, mask):
                if mask is not None and not bool(mask.all()):
                    raise ValueError("HybridLM runs unpadded sequences: attention_mask must be all ones")
                _, hidden = model.backbone(ids)
                return model.lm_head(hidden).float(), hidden
            return cls(model, model.embed_tokens, model.lm_head, None, model.config.hidden_size,
                       model.config.vocab_size, run)
        raise ValueError(f"{type(model).__name__} is not a backbone an MTP head can share: it needs an input "
                         "embedding and an output head (a Hugging Face causal LM or minispec.ssm.hybrid.HybridLM)")

    def logits(self, out: Tensor, shared_grad: bool = True) -> Tensor:
        """out [B, T, H] -> logits [B, T, V] float32. shared_grad=False: gradients reach `out` but not
        the output head's weights (the backbone stays frozen while a head trains through it)."""
        if shared_grad:
            logits = self.head(out).float()
        else:
            bias = None if self.head.bias is None else self.head.bias.detach()
            logits = F.linear(out, self.head.weight.detach(), bias).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @staticmethod
    def hidden(target_out: TargetOutput) -> Tensor:
        if target_out.hidden_states is None:
            raise ValueError("an MTP head reads the backbone's hidden states: run the target with output_hidden_states")
        return target_out.hidden_states[-1]

    def run(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """input_ids [B, S] -> (logits [B, S, V] float32, last hidden state after the final norm [B, S, H])."""
        return self.forward_fn(input_ids, attention_mask)


def check_head_fits(head, backbone: Backbone) -> None:
    """ValueError unless the head's sizes and dtype are the backbone's (it shares its embedding and output head)."""
    config = head.config
    if config.hidden_size != backbone.hidden_size:
        raise ValueError(f"MTP head hidden size {config.hidden_size} != backbone hidden size {backbone.hidden_size}: "
                         "the head reads the backbone's hidden states and shares its embedding")
    if config.vocab_size != backbone.vocab_size:
        raise ValueError(f"MTP head vocab size {config.vocab_size} != backbone vocab size {backbone.vocab_size}: "
                         "the head drafts through the backbone's output head")
    head_dtype, backbone_dtype = next(head.parameters()).dtype, backbone.head.weight.dtype
    if head_dtype != backbone_dtype:
        raise ValueError(f"MTP head is {head_dtype} but the backbone is {backbone_dtype}: convert the head "
                         f"with head.to({backbone_dtype})")
