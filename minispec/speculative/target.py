"""The target model as both decoding loops see it: prefill, extend, a verify forward, and rollback.

    prefill(batch)          the prompts; logits of the last position only          -> [B, 1, V]
    extend(tokens)          plain decoding: feed [B, n] tokens and keep them all    -> [B, n, V]
    forward(tokens)         a verify window: feed [B, n] tokens that may be rolled back
    rollback(keep, n)       of the last forward's n tokens, row b keeps its first keep[b]

    check_speculative(batch)  before any work: refuse what the speculative loop cannot roll back

`target_adapter(model)` picks the adapter, so that every target `minispec.load_target` returns decodes by
both loops: a model with its own cache (minispec.ssm.hybrid.HybridLM, whose Mamba states cannot be
cropped) brings its own through `model.speculative_target(...)`; transformers' `NemotronHForCausalLM`
(lightning-mini as `load_target` returns it) is driven as the HybridLM that shares its weights; any other
Hugging Face causal LM gets `HFTarget`, whose rollback needs a cache of attention layers only.

After a verify forward over [last token, d_1 .. d_K] every sequence has K+1 new cache entries, but
sequence b keeps only `accepted_b + 1` of them. A batched KV cache is one tensor per layer, so the
rows cannot simply be cut to different lengths. Instead each row drops its rejected entries and is
shifted right so that all rows end in the same column — exactly what left padding does to ragged
prompts. The columns that open on the left are masked out by the attention mask, and since each
row's real tokens stay contiguous at the right, a sliding-window layer still sees exactly the last
W-1 real tokens, as plain decoding would.

Sliding-window layers normally keep only W-1 entries and cannot be rolled back once full
(`DynamicSlidingWindowLayer` refuses `crop`, and vLLM and llama.cpp both shipped this bug):
`activate_past_recording()` makes them keep the window *plus* the entries of the last forward, so
the rollback can reach back.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from minispec.speculative.batch import PromptBatch, position_ids
from minispec.speculative.output import TargetOutput


def shift_rows(x: torch.Tensor, drop: torch.Tensor, new_len: int, dim: int, fill=None) -> torch.Tensor:
    """Drop the last `drop[b]` entries of row b along `dim`, then right-align every row into `new_len`.

    x: `[B, ..., L, ...]` with L on `dim`; row b's kept entries end at column `L - drop[b]`. Columns
    that would come from before the start get `fill` (or row b's column 0, to be masked anyway).
    """
    B, L = x.shape[0], x.shape[dim]
    start = L - int(drop.max()) - new_len
    if int(drop.min()) == int(drop.max()) and start >= 0:
        # Every row drops as many (always so at batch 1): a view of the kept columns, no copy of the whole cache
        # (gathering every layer's K/V cost ~5 % of SmolLM2's verify forward on a CPU).
        return x.narrow(dim, start, new_len)
    cols = torch.arange(new_len, device=x.device)
    src = (L - drop.to(x.device))[:, None] - new_len + cols[None, :]  # [B, new_len]
    index_shape = [B] + [1] * (x.dim() - 1)
    index_shape[dim] = new_len
    expand = list(x.shape)
    expand[dim] = new_len
    out = torch.gather(x, dim, src.clamp(min=0).view(index_shape).expand(expand))
    if fill is not None:
        missing = (src < 0).view(index_shape).expand(expand)
        out = out.masked_fill(missing, fill)
    return out


class HFTarget:
    """Any Hugging Face causal LM whose cache is a `DynamicCache` of attention layers."""

    def __init__(self, model, output_hidden_states: bool = False):
        self.model = model
        self.output_hidden_states = output_hidden_states
        self.config = model.config
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] attention mask over every cached column

    def _run(self, input_ids: torch.Tensor, logits_to_keep: int = 0) -> TargetOutput:
        out = self.model(input_ids=input_ids, attention_mask=self.mask,
                         position_ids=position_ids(self.mask)[:, -input_ids.shape[1]:],
                         cache=self.cache, output_hidden_states=self.output_hidden_states,
                         logits_to_keep=logits_to_keep)
        return TargetOutput(out.logits, out.hidden_states if self.output_hidden_states else None)

    def check_speculative(self, batch: PromptBatch) -> None:
        """ValueError unless every cache layer is one `rollback` can cut: plain or sliding-window attention."""
        kinds = {type(layer).__name__ for layer in DynamicCache(config=self.config).layers
                 if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)}
        if kinds:
            raise ValueError(f"speculative decoding cannot roll back {type(self.model).__name__}: its cache has "
                             f"{', '.join(sorted(kinds))} layers, whose recurrent state cannot be cut back to the "
                             "accepted tokens (minispec rolls back attention caches, and Nemotron-H hybrids through "
                             "minispec.ssm.hybrid.HybridLM); decode it with autoregressive_generate")

    @torch.no_grad()
    def prefill(self, batch: PromptBatch) -> TargetOutput:
        self.cache = DynamicCache(config=self.config)
        self.mask = batch.attention_mask
        return self._run(batch.input_ids, logits_to_keep=1)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> TargetOutput:
        """Feed `[B, n]` tokens after everything cached and keep them (plain decoding)."""
        self.mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
        return self._run(tokens)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> TargetOutput:
        """Feed `[B, n]` tokens after everything cached; every row gets n new entries, to be rolled back."""
        self.cache.activate_past_recording()
        self.mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
        return self._run(tokens)

    def rollback(self, keep: torch.Tensor, appended: int) -> None:
        """Of the last `appended` entries, row b keeps its first `keep[b]`; rows are re-aligned."""
        drop = appended - keep
        least = int(drop.min())
        total = self.mask.shape[1] - least
        self.mask = shift_rows(self.mask, drop, total, dim=1, fill=0)
        for layer in self.cache.layers:
            stored = layer.keys.shape[-2]
            # A full layer stores every column; a sliding one only the last window (W-1) of them.
            new_len = stored - least
            if getattr(layer, "is_sliding", False):
                new_len = min(new_len, layer.sliding_window - 1)
                layer.cumulative_length -= least
                layer.record_past = False
            layer.keys = shift_rows(layer.keys, drop, new_len, dim=2)
            layer.values = shift_rows(layer.values, drop, new_len, dim=2)


def check_target(model) -> None:
    """TypeError unless `model` is a target the loops can drive: a causal LM with a config (its vocabulary)
    and a generation config (its EOS and pad ids), as `minispec.load_target` returns."""
    if all(hasattr(model, name) for name in ("config", "generation_config")) and callable(model):
        return
    hint = f": load it first, model, tokenizer = ms.load_target({model!r})" if isinstance(model, str) else ""
    raise TypeError(f"the target must be a causal LM (a Hugging Face model or minispec's HybridLM, as "
                    f"ms.load_target returns), got {type(model).__name__}{hint}")


def max_positions(config) -> int | None:
    """The longest sequence (prompt + new tokens) the model is made for, or None if its config does not say."""
    return getattr(config, "max_position_embeddings", None)


def target_adapter(model, output_hidden_states: bool = False):
    """The adapter the decoding loops drive for `model` (see the module docstring)."""
    check_target(model)
    if hasattr(model, "speculative_target"):
        return model.speculative_target(output_hidden_states)
    if getattr(model.config, "model_type", None) == "nemotron_h":
        from minispec.ssm.hybrid import HybridLM

        return HybridLM.from_hf(model).speculative_target(output_hidden_states)
    return HFTarget(model, output_hidden_states=output_hidden_states)
