"""The DFlash drafter (arXiv:2602.06036; z-lab/dflash `dflash/model.py`), written to read like the paper.

    F   = concat(h_{l_1}, ..., h_{l_n})         target hidden states at the tapped layers   [B, S, n*Ht]
    ctx = hidden_norm(fc(F))                     the "target context feature", made ONCE      [B, S, H]
    x   = embed([anchor, <mask> x (B-1)])        the block, embedded by the TARGET's table     [B, T, H]
    each layer l:
        q       = RoPE(q_norm(q_proj(norm(x))))                     block queries only
        k, v    = [k_l(ctx) ; k_l(norm(x))], [v_l(ctx) ; v_l(norm(x))]   own k/v weights per layer
        x       = x + o_proj(attention(q, k, v))    non-causal: every block query sees the cached
                                                    context before the anchor and the whole block
        x       = x + mlp(norm(x))
    logits = softcap(head(norm(x)))               the target's head (or an own copy), with the
                                                  target's final-logit softcapping; with a reduced
                                                  draft vocabulary, only its rows (`d2t`)

Two ways to run the same weights:

* inference (`draft`): context K/V live in a `DFlashCache` that holds *only committed context*; the
  block's own K/V are used for one forward and never stored, so a rejected draft needs no rollback.
  Attention is `minispec.dflash.attention.dflash_attention`, dispatched on CUDA to its Triton kernel
  `minispec.kernels.attention.dflash_attention` (kernels/attention.py).
* training (`forward`): every anchor's block in one batched forward, with a mask
  (`minispec.dflash.mask.training_mask`) that gives each block query exactly what inference gives
  it, and `minispec.dflash.attention.masked_attention`. `tests/test_dflash_model.py` checks that both
  produce the same logits.

Shapes: B batch, S context length, T block length, H hidden, Hq / Hkv query / key-value heads, D head
dim, V vocabulary. Attention tensors are laid out `[B, T, heads, D]`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel
from transformers.activations import ACT2FN

from minispec.dflash import mask as dmask
from minispec.dflash.attention import dflash_attention, masked_attention
from minispec.dflash.config import SLIDING, DFlashConfig, check_tap_ids

# --------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (Qwen3's RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding, rotate-half ("neox") layout, at absolute positions.

    x: [B, T, heads, D]; positions: [B, T] -> [B, T, heads, D].
    """
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # [B, T, 1, D]
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * angles.cos() + rotated * angles.sin()).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------

# attend(q [B, T, Hq, D], k [B, T, Hkv, D], v [B, T, Hkv, D]) -> [B, T, Hq, D]: the block's own q/k/v in,
# attention over (context + block) out. Inference and training differ only in this function.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DFlashAttention(nn.Module):
    """Qwen3 attention projections: q/k/v/o, per-head RMSNorm on q and k before RoPE."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, D, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.theta = float(config.rope_theta)
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = RMSNorm(D, config.rms_norm_eps)
        self.k_norm = RMSNorm(D, config.rms_norm_eps)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, H], positions [B, T] -> q [B, T, Hq, D]."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        return rope(self.q_norm(q), positions, self.theta)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, n, H] (block tokens or context features), positions [B, n] -> k, v [B, n, Hkv, D]."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return rope(self.k_norm(k), positions, self.theta), v


class DFlashMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        H, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, inner, bias=False)
        self.up_proj = nn.Linear(H, inner, bias=False)
        self.down_proj = nn.Linear(inner, H, bias=False)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """x [B, T, H] at positions [B, T] -> [B, T, H]."""
        h = self.input_layernorm(x)
        q = self.self_attn.queries(h, positions)
        k, v = self.self_attn.keys_values(h, positions)
        x = x + self.self_attn.o_proj(attend(q, k, v).flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------------------------------
# The draft KV cache
# --------------------------------------------------------------------------------------------------


@dataclass
class DFlashCache:
    """Per layer, the K/V of the committed context only (never a block's), left-aligned per row.

    keys[l], values[l]: [B, C_l, Hkv, D]; lengths[l]: [B] real slots of each row (a sliding layer keeps
    at most W-1, all any block query can see); seen: [B] context positions committed so far, which is
    the absolute position of the next anchor.
    """
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: list[torch.Tensor]
    seen: torch.Tensor

    def nbytes(self) -> int:
        """Bytes of the real (unpadded) K/V entries, for comparison with `minispec.costs`."""
        return sum(int(n.sum()) * 2 * k.shape[2] * k.shape[3] * k.element_size()
                   for k, n in zip(self.keys, self.lengths))


def append_rows(old: torch.Tensor, old_len: torch.Tensor, new: torch.Tensor, new_len: torch.Tensor,
                limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b becomes old[b, :old_len[b]] followed by new[b, :new_len[b]], keeping its last `limit` entries.

    old: [B, C, ...]; new: [B, n, ...] -> ([B, C', ...] left-aligned and zero-padded, lengths [B]).
    """
    total = old_len + new_len
    out_len = total if limit is None else total.clamp(max=limit)
    width = int(out_len.max()) if len(out_len) else 0
    # Pad both with one zero slot so every clamped index below is valid, even for C = 0 or n = 0.
    def pad(x):
        return torch.cat([x, x.new_zeros(x.shape[0], 1, *x.shape[2:])], dim=1)

    old, new = pad(old), pad(new)
    col = torch.arange(width, device=old.device)[None, :]
    src = (total - out_len)[:, None] + col  # index into the row's virtual concatenation old ++ new
    from_old = src < old_len[:, None]
    real = col < out_len[:, None]
    old_idx = torch.where(from_old & real, src, old.shape[1] - 1)
    new_idx = torch.where(~from_old & real, src - old_len[:, None], new.shape[1] - 1)

    def take(x, idx):
        return torch.gather(x, 1, idx.view(*idx.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))

    # The pad slot holds zeros, so each slot takes its value from exactly one of the two.
    return take(old, old_idx) + take(new, new_idx), out_len


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


class DFlashDraftModel(PreTrainedModel):
    """A DFlash drafter. Weight names match the HF-native DFlash format (`fc`, `hidden_norm`,
    `layers.{i}....`, `norm`, optional `lm_head`), without a `model.` prefix.

    The token embedding (and, unless `config.has_own_lm_head`, the output head) belong to the target:
    call `attach_target(target)` (or build with `for_target`) before running the drafter.
    """

    config_class = DFlashConfig
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(config.num_taps * config.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if config.draft_vocab_size is not None:
            # EAGLE-3's layout: draft id i stands for target id i + d2t[i] (ascending target ids).
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        if config.has_own_lm_head:
            self.lm_head = nn.Linear(H, config.draft_vocab_size or config.vocab_size, bias=False)
        self._target = None  # (embedding module, head module) of the attached target; not saved
        self._head_rows = None  # ((head weight, d2t), their versions, the gathered rows): see `head_weight`
        self.post_init()

    # --- the target's parts ---------------------------------------------------------------------

    @classmethod
    def for_target(cls, config: DFlashConfig, target) -> DFlashDraftModel:
        """A freshly initialised drafter attached to `target`; an own head of the target's shape starts
        as a copy of the target's head (E4B's layout), any other own head at random."""
        model = cls(config).to(dtype=target.dtype)
        model.attach_target(target)
        if (config.has_own_lm_head and config.draft_vocab_size is None
                and model.lm_head.weight.shape == target.get_output_embeddings().weight.shape):
            with torch.no_grad():
                model.lm_head.weight.copy_(target.get_output_embeddings().weight)
        return model

    def attach_target(self, target) -> None:
        """Check that the drafter fits `target` and borrow its embedding (and head, if shared)."""
        cfg, tcfg = self.config, target.config
        if tcfg.vocab_size != cfg.vocab_size:
            raise ValueError(f"drafter vocab size {cfg.vocab_size} != target vocab size {tcfg.vocab_size}: drafter "
                             "and target must share one tokenizer")
        if tcfg.hidden_size != cfg.target_hidden_size:
            raise ValueError(f"drafter expects target hidden size {cfg.target_hidden_size} (fc reads "
                             f"{cfg.num_taps} x {cfg.target_hidden_size} features) but the target's hidden size is "
                             f"{tcfg.hidden_size}")
        if cfg.num_target_layers is not None and cfg.num_target_layers != tcfg.num_hidden_layers:
            raise ValueError(f"drafter was built for a {cfg.num_target_layers}-layer target, this target has "
                             f"{tcfg.num_hidden_layers} layers")
        check_tap_ids(cfg.target_layer_ids, tcfg.num_hidden_layers)
        softcap = getattr(tcfg, "final_logit_softcapping", None)
        if softcap != cfg.final_logit_softcapping:
            raise ValueError(f"drafter applies final_logit_softcapping={cfg.final_logit_softcapping} but the target "
                             f"uses {softcap}: a drafter must produce logits the way its target does")
        head = target.get_output_embeddings()
        if not cfg.has_own_lm_head and head.weight.shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"the target's head is {tuple(head.weight.shape)}, the drafter needs "
                             f"({cfg.vocab_size}, {cfg.hidden_size}) to share it")
        self._target = (target.get_input_embeddings(), head)

    def _parts(self):
        if self._target is None:
            raise RuntimeError("the drafter has no target attached: call model.attach_target(target) first (the "
                               "token embedding, and the head unless has_own_lm_head, are the target's)")
        return self._target

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] token ids -> [..., H] through the TARGET's embedding module, with its scaling (Gemma
        multiplies by sqrt(hidden): a drafter that looked the rows up itself would miss it)."""
        return self._parts()[0](ids).to(self.dtype)

    # --- the draft vocabulary ----------------------------------------------------------------------

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Draft over these target token ids only (e.g. the most frequent ones in the training replies)."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).unique()  # sorted ascending, as EAGLE-3 stores them
        if self.config.draft_vocab_size is None or len(ids) != self.config.draft_vocab_size:
            raise ValueError(f"this drafter's draft_vocab_size is {self.config.draft_vocab_size}; got {len(ids)} "
                             "distinct token ids")
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size})")
        self.d2t.copy_(ids - torch.arange(len(ids)))

    def draft_vocab(self) -> torch.Tensor | None:
        """[Vd] the target id of each draft id, or None when the drafter drafts over the whole vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (argmax positions of `output_logits`) -> target token ids."""
        vocab = self.draft_vocab()
        return draft_ids if vocab is None else vocab.to(draft_ids.device)[draft_ids]

    def to_draft_ids(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target token ids -> draft ids, -1 for a token outside the draft vocabulary."""
        vocab = self.draft_vocab()
        if vocab is None:
            return target_ids
        lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        lookup[vocab.to(target_ids.device)] = torch.arange(len(vocab), device=target_ids.device)
        return lookup[target_ids]

    def to_target_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] probabilities over the draft vocabulary -> [..., V] over the target's (0 elsewhere)."""
        vocab = self.draft_vocab()
        if vocab is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        return out.index_copy_(-1, vocab.to(probs.device), probs)

    def head_weight(self) -> torch.Tensor:
        """[Vd, H] the output head over the draft vocabulary. A head borrowed from the target is the target's
        rows of the draft vocabulary: gathered afresh while gradients are on (training), and at inference
        gathered once and kept until the target's head or the vocabulary changes (in place or for another
        tensor). Gathering 8,192 of SmolLM2's 49,152 rows on every draft took about a third of a bfloat16
        draft cycle on a CPU."""
        if self.config.has_own_lm_head:
            return self.lm_head.weight
        weight, vocab = self._parts()[1].weight, self.draft_vocab()
        if vocab is None:
            return weight
        if torch.is_grad_enabled():
            return weight.index_select(0, vocab.to(weight.device))
        versions = (weight._version, self.d2t._version)
        cached = self._head_rows
        if cached is None or cached[0][0] is not weight or cached[0][1] is not self.d2t or cached[1] != versions:
            self._head_rows = ((weight, self.d2t), versions, weight.index_select(0, vocab.to(weight.device)))
        return self._head_rows[2]

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden [..., H] -> logits [..., Vd] over the draft vocabulary (the target's whole vocabulary
        unless `draft_vocab_size` is set): the head (`head_weight`), then the target's softcapping."""
        logits = F.linear(x, self.head_weight().to(x.dtype))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def tap(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """HF `hidden_states` (index 0 = embeddings, i + 1 = output of layer i) -> F [B, S, n * Ht]."""
        return torch.cat([hidden_states[i + 1] for i in self.config.target_layer_ids], dim=-1).to(self.dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """F [B, S, n * Ht] -> ctx [B, S, H] = hidden_norm(fc(F)), once for all layers."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    # --- inference --------------------------------------------------------------------------------

    def new_cache(self, batch_size: int) -> DFlashCache:
        kv = self.config.num_key_value_heads, self.config.head_dim
        n = len(self.layers)

        def empty():
            return torch.zeros(batch_size, 0, *kv, dtype=self.dtype, device=self.device)

        def zeros():
            return torch.zeros(batch_size, dtype=torch.long, device=self.device)

        return DFlashCache([empty() for _ in range(n)], [empty() for _ in range(n)], [zeros() for _ in range(n)],
                           zeros())

    def extend_cache(self, cache: DFlashCache, features: torch.Tensor, keep: torch.Tensor) -> None:
        """Commit context: row b appends the features where keep[b] is True, in order, at its next positions.

        features [B, n, n_taps * Ht]; keep [B, n] bool (the prefill's attention mask; after a verify, the
        accepted prefix). Each layer projects the context with its own k/v weights; k gets k_norm and
        RoPE at the tokens' absolute positions. Sliding layers keep only the last W-1 entries.
        """
        keep = keep.to(self.device).bool()
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept entries first, in order
        features = torch.gather(features.to(self.device), 1,
                                order[..., None].expand(-1, -1, features.shape[-1]))
        count = keep.sum(dim=1)
        ctx = self.context(features)
        positions = cache.seen[:, None] + torch.arange(ctx.shape[1], device=self.device)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, positions)
            window = self.config.window_of(i)
            limit = None if window is None else window - 1
            cache.keys[i], lengths = append_rows(cache.keys[i], cache.lengths[i], k, count, limit)
            cache.values[i], _ = append_rows(cache.values[i], cache.lengths[i], v, count, limit)
            cache.lengths[i] = lengths
        cache.seen = cache.seen + count

    def draft(self, block_ids: torch.Tensor, cache: DFlashCache) -> torch.Tensor:
        """One non-causal forward over a block: block_ids [B, T] (anchor, then masks) -> logits [B, T, Vd].

        The block sits at positions seen .. seen + T - 1 of each row. Its K/V are used and dropped: the
        cache is not changed, so it keeps holding committed context only.
        """
        T = block_ids.shape[1]
        positions = cache.seen[:, None] + torch.arange(T, device=self.device)
        x = self.embed(block_ids)
        for i, layer in enumerate(self.layers):
            def attend(q, k, v, i=i):
                return dflash_attention(q, cache.keys[i], cache.values[i], k, v, cache.lengths[i],
                                        self.config.window_of(i))
            x = layer(x, positions, attend)
        return self.output_logits(self.norm(x))

    # --- training ---------------------------------------------------------------------------------

    def forward_blocks(self, block_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
                       allow: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """All blocks of a sequence in one forward, with an explicit mask.

        block_ids, positions: [B, Q] (Q = N blocks x T, block after block); features: [B, S, n * Ht]
        (context position c = row c); allow[layer type]: [B, Q, S + Q] over keys [context ; blocks].
        -> logits [B, Q, Vd].
        """
        ctx = self.context(features)
        ctx_positions = torch.arange(ctx.shape[1], device=self.device).expand(ctx.shape[0], -1)
        x = self.embed(block_ids)
        for i, layer in enumerate(self.layers):
            k_ctx, v_ctx = layer.self_attn.keys_values(ctx, ctx_positions)
            mask = allow[self.config.layer_types[i]]

            def attend(q, k, v, k_ctx=k_ctx, v_ctx=v_ctx, mask=mask):
                return masked_attention(q, torch.cat([k_ctx, k], 1), torch.cat([v_ctx, v], 1), mask)
            x = layer(x, positions, attend)
        return self.output_logits(self.norm(x))

    def training_masks(self, blocks: dmask.Blocks, seq_len: int) -> dict[str, torch.Tensor]:
        """One training mask per layer type: sliding layers add the window."""
        return {kind: dmask.training_mask(blocks.anchors, blocks.valid, seq_len, self.config.block_size,
                                          self.config.sliding_window if kind == SLIDING else None)
                for kind in set(self.config.layer_types)}

    def forward(self, features: torch.Tensor, blocks: dmask.Blocks) -> torch.Tensor:
        """Training mode: features [B, S, n * Ht] of a whole sequence, `blocks` from `mask.make_blocks`
        -> logits [B, N, T, Vd]; block position k is trained to predict x[anchor + k]."""
        B, N, T = blocks.input_ids.shape
        if T != self.config.block_size:
            raise ValueError(f"blocks have {T} positions but the drafter's block_size is {self.config.block_size}")
        logits = self.forward_blocks(blocks.input_ids.flatten(1), blocks.positions.flatten(1), features,
                                     self.training_masks(blocks, features.shape[1]))
        return logits.unflatten(1, (N, T))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# So that AutoConfig / AutoModel open a folder written by `DFlashDraftModel.save_pretrained`.
AutoConfig.register(DFlashConfig.model_type, DFlashConfig, exist_ok=True)
AutoModel.register(DFlashConfig, DFlashDraftModel, exist_ok=True)


__all__ = ["DFlashCache", "DFlashDraftModel", "RMSNorm", "append_rows", "num_parameters", "rope"]
