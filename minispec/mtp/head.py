"""The MTP head: one Nemotron/DeepSeek-style multi-token-prediction layer, called recursively.

One call (a "depth") reads a hidden state h [B, T, H] and the embedding of the token that follows it:

    x   = eh_proj( concat( enorm(embed(next_token)), hnorm(h) ) )      2H -> H, no bias
    x   = x + mixer_l(norm_l(x))      for each layer l of the block (pattern "*-": attention, then MLP;
                                      Nemotron 3.5's head is "*E": attention, then MoE)
    out = final_layernorm(x)                                             [B, T, H]
    logits = backbone's output head(out)                                 (shared, not the head's own)

Depth 1 reads the backbone's last hidden state (after its final norm, what its own head reads); depth k
reads the `out` of depth k-1, so K calls of the same weights draft K tokens. The backbone's hidden state
at a position predicts the token two ahead through depth 1; depth 1's `out` stands in for the backbone's
hidden state one position later, and so on.

When it drafts, the head's attention reads a *stitched* context: the entries of the verified prefix were
built from the backbone's hidden states (depth-1 entries), only the current round's entries (depths
1..k-1 of this draft) come from the head's own outputs. `StitchedContext` reproduces exactly that for
every possible cycle start at once (test-time training); training that feeds every position the head's
own stand-ins, or mixes them with the backbone's (boost.py), does not.

Weights are named as in Nemotron-H checkpoints (`mtp.layers.{i}.enorm / hnorm / eh_proj` on the first
layer of the block, `mtp.layers.{i}.norm` + `mixer.*` on every layer, `final_layernorm` on the last);
`head.state_dict(prefix="mtp.")` gives those names. Attention has no positional encoding, as in
Nemotron-H (its Mamba layers carry order; the MTP block's attention is NoPE).

The head's attention keeps its own key/value cache (`MTPCache`) over the positions it has seen. Rows of
a batch may hold different numbers of positions (they accept different numbers of drafts), so every
row writes at its own slot offset and a validity mask hides padding.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minispec.manifest import check_manifest
from minispec.ssm.hybrid import MLP, Attention, MoE, RMSNorm

MIXERS = {"*": "attention", "-": "mlp", "E": "moe"}
MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
              "routed_scaling_factor", "norm_topk_prob")


@dataclass
class MTPConfig:
    hidden_size: int
    vocab_size: int
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    pattern: str = "*-"  # the block's layers, Nemotron-H letters: * attention, - MLP, E MoE
    layer_norm_epsilon: float = 1e-5
    # E layers: routed experts (sigmoid scores, top-k) + one shared expert, as Nemotron-H's MoE
    n_routed_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    moe_shared_expert_intermediate_size: int = 128
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def __post_init__(self):
        if not self.pattern or any(c not in MIXERS for c in self.pattern):
            raise ValueError(f"MTP pattern {self.pattern!r}: use the letters {''.join(MIXERS)} "
                             "(* attention, - MLP, E MoE), at least one layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    @classmethod
    def like(cls, backbone_config, **overrides) -> MTPConfig:
        """Sizes taken from a backbone's HF config (hidden size, vocab, heads, MLP width, eps)."""
        c = backbone_config
        fields = dict(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                      num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                      intermediate_size=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
                      layer_norm_epsilon=getattr(c, "layer_norm_epsilon", None) or getattr(c, "rms_norm_eps", 1e-5))
        fields.update({f: getattr(c, f) for f in MOE_FIELDS if getattr(c, f, None) is not None})
        fields.update(overrides)
        return cls(**fields)


class MTPCache:
    """Keys/values of the head's attention layers, per row at its own slots.

    keys[l], values[l]: [B, Hkv, capacity, d]; valid [B, capacity] marks real positions (prompt padding
    is not); length [B] counts the committed slots of each row. Slots at or past `length` hold
    tentative entries (drafts) that the next `commit` overwrites.
    """

    def __init__(self, batch_size: int, device, capacity: int = 64):
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)
        self.length = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.valid.shape[1]

    def reserve(self, end: int) -> None:
        """Grow every buffer so slots < end exist (doubling, so appends stay amortised O(1))."""
        if end <= self.capacity:
            return
        extra = max(end, 2 * self.capacity) - self.capacity
        self.valid = F.pad(self.valid, (0, extra))
        for store in (self.keys, self.values):
            for i, t in store.items():
                store[i] = F.pad(t, (0, 0, 0, extra))

    def write_valid(self, slots: Tensor, valid: Tensor) -> None:
        self.reserve(int(slots.max()) + 1)
        self.valid.scatter_(1, slots, valid)


class StitchedContext:
    """The attention context of every cycle start at once: what the drafter's cache holds, for test-time
    training (EAGLE-3's "training-time test", SafeAILab/EAGLE eagle/traineagle3/cnets.py).

    Positions are cycle starts c: chain c begins with depth 1 reading the backbone's h_c, and its depth k
    sits where the drafter puts it, at slot c+k-1. When depth k of chain c drafts, the drafter's cache holds

        slots 0 .. c-1      the verified prefix: depth-1 entries, built from the backbone's hidden states
        slot  c             this round's depth 1 (the backbone's h_c, too)
        slots c+1 .. c+k-1  this round's depths 2..k: built from the head's own outputs

    so depth k's query of chain c sees the depth-1 keys of chains c' <= c (causal) and the keys of depths
    2..k of its own chain (a diagonal per depth). keys[layer] / values[layer]: per attention layer, one
    [B, Hkv, S, d] per depth run so far; valid [B, S]: the chains whose depth-1 entry is real.
    """

    def __init__(self, valid: Tensor):
        self.valid = valid
        self.keys: dict[int, list[Tensor]] = {}
        self.values: dict[int, list[Tensor]] = {}


class MTPAttention(Attention):
    """The backbone's attention (same projections and weight names), with an optional `MTPCache` or
    `StitchedContext`."""

    def forward(self, x: Tensor, valid: Tensor, cache: MTPCache | StitchedContext | None = None, layer: int = 0,
                slots: Tensor | None = None) -> Tensor:
        """x [B, T, D]; valid [B, T] (False for padding).

        Without a cache: causal attention over the T positions. With one: the T positions go to `slots`
        [B, T] (row b's consecutive slots), and query t of row b sees the row's valid slots up to its own.
        With a StitchedContext: the T positions are the chains of one depth (see StitchedContext).
        """
        B, T, _ = x.shape
        q, k, v = self.project(x)
        if isinstance(cache, StitchedContext):
            return self.o_proj(self.stitched(q, k, v, cache, layer).transpose(1, 2).reshape(B, T, -1))
        if cache is None:
            key_valid = valid
            key_slot = query_slot = torch.arange(T, device=x.device).expand(B, T)
        else:
            if layer not in cache.keys:
                shape = (B, self.num_kv, cache.capacity, self.head_dim)
                cache.keys[layer], cache.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
            index = slots[:, None, :, None].expand(B, self.num_kv, T, self.head_dim)
            cache.keys[layer].scatter_(2, index, k)
            cache.values[layer].scatter_(2, index, v)
            k, v = cache.keys[layer], cache.values[layer]
            key_valid = cache.valid
            key_slot = torch.arange(cache.capacity, device=x.device).expand(B, -1)
            query_slot = slots
        visible = key_valid[:, None, :] & (key_slot[:, None, :] <= query_slot[:, :, None])  # [B, T, L]
        # A padding query would see nothing; let it see its own slot so softmax stays finite (its output is
        # unused). Slots past a query's own may hold stale drafts of an earlier propose: never visible.
        visible = visible | (key_slot[:, None, :] == query_slot[:, :, None])
        rep = self.num_heads // self.num_kv
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=visible[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def stitched(self, q: Tensor, k: Tensor, v: Tensor, context: StitchedContext, layer: int) -> Tensor:
        """Depth k = (depths stored so far) + 1 over every chain c: q [B, Hq, S, d], this depth's k, v
        [B, Hkv, S, d] -> [B, Hq, S, d]. Scores against the depth-1 keys of chains c' <= c, then one score
        per depth 2..k against the key of the same chain c; one softmax over both."""
        keys, values = context.keys.setdefault(layer, []), context.values.setdefault(layer, [])
        keys.append(k)
        values.append(v)
        rep = self.num_heads // self.num_kv
        scale = self.head_dim ** -0.5
        S = q.shape[2]
        prefix_k, prefix_v = keys[0].repeat_interleave(rep, 1), values[0].repeat_interleave(rep, 1)
        chain = torch.arange(S, device=q.device)
        visible = context.valid[:, None, None, :] & (chain[None, :] <= chain[:, None])
        visible = visible | torch.eye(S, dtype=torch.bool, device=q.device)  # a padding chain sees itself
        prefix = (q @ prefix_k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))  # [B, Hq, S, S]
        own = [(q * km.repeat_interleave(rep, 1)).sum(-1, keepdim=True) * scale for km in keys[1:]]
        weights = torch.softmax(torch.cat([prefix, *own], dim=-1), dim=-1)  # [B, Hq, S, S + k-1]
        out = weights[..., :S] @ prefix_v
        for m, vm in enumerate(values[1:]):
            out = out + weights[..., S + m, None] * vm.repeat_interleave(rep, 1)
        return out


class MTPLayer(nn.Module):
    """One layer of the head's block: x + mixer(norm(x)); the first also fuses, the last also norms."""

    def __init__(self, cfg: MTPConfig, letter: str, first: bool, last: bool):
        super().__init__()
        self.kind = MIXERS[letter]
        if first:
            self.enorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
            self.hnorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
            self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if self.kind == "attention":
            self.mixer = MTPAttention(cfg)
        elif self.kind == "mlp":
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mixer = _moe(cfg)
        if last:
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


def _moe(cfg: MTPConfig) -> MoE:
    """Nemotron-H's MoE (minispec.ssm.hybrid, same parameter names), its expert weights initialised here:
    HybridLM leaves them at zero for a checkpoint to fill, and all-zero experts never get a gradient."""
    moe = MoE(SimpleNamespace(hidden_size=cfg.hidden_size, n_group=1, moe_latent_size=None,
                              **{f: getattr(cfg, f) for f in MOE_FIELDS}))
    for w in (moe.gate.weight, moe.experts.up_proj, moe.experts.down_proj):
        nn.init.normal_(w, std=0.02)
    return moe


class MTPHead(nn.Module):
    """The MTP layer (a block of `config.pattern`); `forward` is one depth, `depths` the recursion."""

    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        n = len(config.pattern)
        self.layers = nn.ModuleList([MTPLayer(config, c, i == 0, i == n - 1) for i, c in enumerate(config.pattern)])

    def forward(self, hidden: Tensor, next_embeds: Tensor, valid: Tensor | None = None,
                cache: MTPCache | StitchedContext | None = None, slots: Tensor | None = None) -> Tensor:
        """One depth: hidden [B, T, H] and the embeddings of the tokens after them [B, T, H] -> out [B, T, H].

        valid [B, T] (default all True) hides padding from attention. With an MTPCache, `slots` [B, T]
        says where each position goes; with a StitchedContext, the T positions are cycle starts and the
        call is the next depth of every chain (see MTPAttention).
        """
        if valid is None:
            valid = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        if isinstance(cache, MTPCache):
            cache.write_valid(slots, valid)
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(next_embeds), first.hnorm(hidden)], dim=-1))
        for i, layer in enumerate(self.layers):
            h = layer.norm(x)
            x = x + (layer.mixer(h, valid, cache, i, slots) if layer.kind == "attention" else layer.mixer(h))
        return self.layers[-1].final_layernorm(x)

    # -- saving, in Nemotron-H names ------------------------------------------------------------
    def save_pretrained(self, folder) -> Path:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "mtp_config.json").write_text(json.dumps(asdict(self.config), indent=1))
        save_file({k: v.contiguous() for k, v in self.state_dict(prefix="mtp.").items()}, folder / "mtp.safetensors")
        return folder

    @classmethod
    def from_pretrained(cls, folder, dtype: torch.dtype = torch.float32) -> MTPHead:
        """The head saved in `folder` (mtp_config.json + mtp.safetensors), checked against the folder's
        SHA256SUMS when it has one (`minispec.manifest`)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        check_manifest(folder)
        head = cls(MTPConfig(**json.loads((folder / "mtp_config.json").read_text())))
        state = load_file(folder / "mtp.safetensors")
        if any(not k.startswith("mtp.") for k in state):
            raise ValueError(f"{folder / 'mtp.safetensors'}: every weight name must start with 'mtp.'")
        head.load_state_dict({k[len("mtp."):]: v for k, v in state.items()}, strict=True)
        return head.to(dtype).eval()
