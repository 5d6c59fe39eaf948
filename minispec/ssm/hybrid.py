"""minispec's own Nemotron-H hybrid forward (lightning-mini), with its own cache of Mamba states and KV.

The layers follow a Nemotron-H `hybrid_override_pattern` (M = Mamba-2, * = attention, - = relu^2 MLP,
E = routed MoE MLP + a shared expert); each is `h = h + mixer(RMSNorm(h))`, then a final RMSNorm and
an untied output head. Parameter names equal transformers' `NemotronHForCausalLM`
(`model.embeddings`, `model.layers.{i}.norm`, `model.layers.{i}.mixer.*`, `model.norm_f`, `lm_head`),
so one state dict loads into either.

The cache (`HybridCache`) holds, per attention layer, keys and values [b, Hkv, S, d], and per Mamba
layer a `MambaLayerStore` (`minispec.ssm.replay`): per-position states or checkpoint + replay. A
forward either keeps all its tokens (`commit=True`: prefill, plain decoding) or leaves them pending
(`commit=False`: a speculative verify window) until `cache.commit(n)` keeps the first n.

Nemotron-H attention has no positional encoding (the Mamba layers carry order), so a rollback of an
attention layer is a plain crop.

dt clamp: the config's `time_step_limit`, in every path, as transformers (5.25 and later) applies it;
lightning-mini's says (time_step_min, inf), the clamp it was trained with.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from minispec.speculative.output import TargetOutput
from minispec.ssm.config import Mamba2Config
from minispec.ssm.mamba2 import Mamba2Mixer
from minispec.ssm.replay import MambaLayerStore, make_store

__all__ = ["RMSNorm", "Attention", "MLP", "MoE", "HybridLM", "HybridCache", "HybridOutput"]

LETTERS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


class RMSNorm(nn.Module):
    """weight * x / rms(x), computed in float32, returned in the input dtype (as Nemotron-H)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(h.dtype) * h).to(x.dtype)


def relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


class MLP(nn.Module):
    """down(relu(up(x))^2): Nemotron-H's non-gated MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class _Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))


class _Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.zeros(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))


class MoE(nn.Module):
    """Routed experts + one shared expert, as Nemotron-H (single routing group).

    score_e = sigmoid(router_e . x); the top-k experts by score + e_score_correction_bias are chosen,
    their scores renormalised to sum 1 and scaled; out = sum_chosen w_e expert_e(x) + shared(x).
    Every expert runs on every token here (E is small); unchosen experts get weight 0.
    """

    def __init__(self, cfg):
        super().__init__()
        if cfg.n_group != 1 or cfg.moe_latent_size is not None:
            raise ValueError("MoE: only one routing group and no latent projection are implemented "
                             f"(n_group={cfg.n_group}, moe_latent_size={cfg.moe_latent_size})")
        self.top_k, self.scale, self.norm_topk = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob
        self.gate = _Router(cfg.n_routed_experts, cfg.hidden_size)
        self.experts = _Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size)

    def routing(self, x: Tensor) -> Tensor:
        """x [..., D] -> weights [..., E] (zero for experts not chosen)."""
        scores = torch.sigmoid(F.linear(x.float(), self.gate.weight.float()))
        chosen = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1).indices
        w = scores.gather(-1, chosen)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return torch.zeros_like(scores).scatter(-1, chosen, w * self.scale)

    def forward(self, x: Tensor) -> Tensor:
        w = self.routing(x).to(x.dtype)  # [..., E]
        h = relu2(torch.einsum("...d,eid->...ei", x, self.experts.up_proj))
        y = torch.einsum("...ei,edi->...ed", h, self.experts.down_proj)
        return torch.einsum("...e,...ed->...d", w, y) + self.shared_experts(x)


class Attention(nn.Module):
    """Causal grouped-query attention without positional encoding (Nemotron-H)."""

    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.num_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [b, T, D] -> q [b, Hq, T, d], k and v [b, Hkv, T, d]."""
        b, T, _ = x.shape
        q = self.q_proj(x).view(b, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, T, self.num_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, T, self.num_kv, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x: Tensor, past: tuple[Tensor, Tensor] | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [b, T, D]; past (k, v) [b, Hkv, S, d] or None -> out [b, T, D], (k, v) [b, Hkv, S+T, d]."""
        b, T, _ = x.shape
        q, k, v = self.project(x)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        S = k.shape[2]
        rep = self.num_heads // self.num_kv
        visible = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)  # query t sees keys <= S-T+t
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             attn_mask=visible)
        return self.o_proj(out.transpose(1, 2).reshape(b, T, -1)), (k, v)


@dataclass
class HybridOutput:
    logits: Tensor  # [b, T, V]
    hidden_pre_norm: Tensor  # [b, T, D] the last layer's output, before the final norm
    hidden: Tensor  # [b, T, D] after the final norm (what the head reads)


class HybridCache:
    """Per-layer decoding state: KV for attention layers, a `MambaLayerStore` for Mamba layers."""

    def __init__(self, model: HybridLM, batch_size: int, strategy: str = "replay", capacity: int = 16,
                 dtype: torch.dtype | None = None):
        self.strategy, self.capacity = strategy, capacity
        self.kv: dict[int, tuple[Tensor, Tensor]] = {}
        self.mamba: dict[int, MambaLayerStore] = {}
        for i, layer in enumerate(model.model.layers):
            if layer.block_type == "linear_attention":
                state = layer.mixer.init_state(batch_size, dtype=dtype)
                self.mamba[i] = make_store(strategy, layer.mixer, state, capacity)
        self.length = 0  # committed tokens
        self.pending = 0

    def commit(self, n: int) -> None:
        """Keep the first n tokens of the last (uncommitted) forward in every layer."""
        if not isinstance(n, int) or not 1 <= n <= self.pending:
            raise ValueError(f"HybridCache.commit({n!r}): the last forward left {self.pending} pending token(s)")
        for store in self.mamba.values():
            store.commit(n)
        keep = self.length + n
        self.kv = {i: (k[:, :, :keep], v[:, :, :keep]) for i, (k, v) in self.kv.items()}
        self.length, self.pending = keep, 0

    def traffic(self) -> tuple[int, int]:
        """(bytes read, bytes written) of Mamba state by all layers so far (prefill excluded)."""
        return (sum(s.traffic.read for s in self.mamba.values()), sum(s.traffic.written for s in self.mamba.values()))


class HybridBlock(nn.Module):
    def __init__(self, cfg, mamba_cfg: Mamba2Config, layer_idx: int):
        super().__init__()
        self.block_type = cfg.layers_block_type[layer_idx]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if self.block_type == "linear_attention":
            self.mixer = Mamba2Mixer(mamba_cfg, layer_idx)
        elif self.block_type == "full_attention":
            self.mixer = Attention(cfg)
        elif self.block_type == "mlp":
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mixer = MoE(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg, mamba_cfg: Mamba2Config):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([HybridBlock(cfg, mamba_cfg, i) for i in range(len(cfg.layers_block_type))])
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class HybridLM(nn.Module):
    """lightning-mini (any Nemotron-H config without MTP layers), forward + cache in plain PyTorch.

    forward(ids [b, T], cache=None, commit=True) -> HybridOutput (logits, hidden pre/post final norm)
    backbone(ids, cache, commit) -> (hidden_pre_norm, hidden)    for heads that read the trunk (MTP)
    embed_tokens / lm_head                                        the shared embedding and output head
    new_cache(batch, strategy, capacity) -> HybridCache
    """

    def __init__(self, config):
        super().__init__()
        if getattr(config, "num_nextn_predict_layers", 0):
            raise ValueError("HybridLM: configs with MTP layers are not supported")
        self.config = config
        self.mamba_config = Mamba2Config.from_nemotron_h(config)
        self.model = _Backbone(config, self.mamba_config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        from transformers import GenerationConfig
        self.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                                                  bos_token_id=config.bos_token_id)

    @property
    def pattern(self) -> str:
        return "".join(LETTERS[layer.block_type] for layer in self.model.layers)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embeddings

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # construction -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_model) -> HybridLM:
        """A transformers `NemotronHForCausalLM` as a HybridLM that shares its weight tensors (strict: every name
        must match): nothing is copied, and a change to either model's weights is a change to both. Modules that
        `minispec.quant.quantize` put in (they name their packed weights in `weight_names`) carry over as they are."""
        with torch.device("meta"):
            model = cls(hf_model.config)
        for name, module in hf_model.named_modules():
            if hasattr(module, "weight_names"):
                model.set_submodule(name, module)
        model.load_state_dict(hf_model.state_dict(), strict=True, assign=True)
        return model.eval()

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> HybridLM:
        """A shipped name ("lightning-mini") or a Nemotron-H folder.

        The folder is in the layout NVIDIA's Nemotron-H checkpoints use on the Hub (`backbone.*`, one
        tensor pair per expert); transformers converts it on load, and the weights are taken from there.
        """
        from transformers import AutoModelForCausalLM

        from minispec.targets.load import resolve
        return cls.from_hf(AutoModelForCausalLM.from_pretrained(resolve(name_or_path), dtype=dtype))

    def new_cache(self, batch_size: int = 1, strategy: str = "replay", capacity: int = 16) -> HybridCache:
        return HybridCache(self, batch_size, strategy, capacity, dtype=self.lm_head.weight.dtype)

    def speculative_target(self, output_hidden_states: bool = False, strategy: str | None = None,
                           capacity: int | None = None) -> HybridTarget:
        """The adapter both decoding loops drive (`minispec.speculative.target`): prefill / extend / verify
        forward / rollback.
        strategy / capacity default to `self.spec_strategy` / `self.spec_capacity` ("replay", 16).
        The newest adapter stays reachable as `self.last_target`, so its cache (and the state traffic
        it counted) can be inspected after a run."""
        self.last_target = HybridTarget(self, output_hidden_states, strategy or self.spec_strategy,
                                        capacity or self.spec_capacity)
        return self.last_target

    spec_strategy: str = "replay"
    spec_capacity: int = 16

    # forward ------------------------------------------------------------------------------------
    def backbone(self, input_ids: Tensor, cache: HybridCache | None = None, commit: bool = True):
        """input_ids [b, T] -> (hidden_pre_norm [b, T, D], hidden [b, T, D]).

        With a cache, the T tokens follow everything committed in it; commit=False leaves them pending
        (a verify window) until `cache.commit(n)`. Without a cache, a stateless full-sequence pass.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"HybridLM: input_ids must be [b, T], got {tuple(input_ids.shape)}")
        if cache is not None and cache.pending:
            raise ValueError(f"HybridLM: the cache holds {cache.pending} uncommitted token(s); call cache.commit(n)")
        h = self.model.embeddings(input_ids)
        T = input_ids.shape[1]
        for i, layer in enumerate(self.model.layers):
            x = layer.norm(h)
            kind = layer.block_type
            if kind == "linear_attention":
                if cache is None:
                    y, _ = layer.mixer(x)
                elif commit and T > 1:
                    y = cache.mamba[i].extend(x)
                else:
                    y = cache.mamba[i].verify(x)
                    if commit:
                        cache.mamba[i].commit(T)
            elif kind == "full_attention":
                y, kv = layer.mixer(x, None if cache is None else cache.kv.get(i))
                if cache is not None:
                    cache.kv[i] = kv
            else:
                y = layer.mixer(x)
            h = h + y
        if cache is not None:
            if commit:
                cache.length += T
            else:
                cache.pending = T
        return h, self.model.norm_f(h)

    def forward(self, input_ids: Tensor, cache: HybridCache | None = None, commit: bool = True) -> HybridOutput:
        pre, post = self.backbone(input_ids, cache, commit)
        return HybridOutput(self.lm_head(post).float(), pre, post)


class HybridTarget:
    """`HybridLM` as the decoding loops see it (same methods as `minispec.speculative.target.HFTarget`).

    Plain decoding (`extend`) commits its tokens at once. A verify forward leaves its K+1 tokens
    pending in every layer; `rollback(keep, appended)` commits the first keep[b] of them: KV is
    cropped, and each Mamba store keeps its own way (pick a saved per-position state, or move the
    replay counter). The Mamba stores of a batch advance together, so prompts must be unpadded (equal
    lengths) and every row must keep the same number of tokens: speculative decoding, whose rows
    accept differently, runs one sequence at a time.
    hidden_states, when asked for, is (last layer before the final norm, after it), each [b, n, D].
    """

    def __init__(self, model: HybridLM, output_hidden_states: bool = False, strategy: str = "replay",
                 capacity: int = 16):
        self.model, self.output_hidden_states = model, output_hidden_states
        self.strategy, self.capacity = strategy, capacity
        self.config = model.config
        self.cache: HybridCache | None = None

    def _out(self, out: HybridOutput, last_only: bool = False) -> TargetOutput:
        logits = out.logits[:, -1:] if last_only else out.logits
        return TargetOutput(logits, (out.hidden_pre_norm, out.hidden) if self.output_hidden_states else None)

    def check_speculative(self, batch) -> None:
        """ValueError for a batch: its rows would accept different numbers of drafts (see the class docstring)."""
        if batch.size > 1:
            raise ValueError(f"speculative decoding on a hybrid (Mamba) model runs one unpadded sequence at a time, "
                             f"got a batch of {batch.size}: call it once per prompt (autoregressive_generate takes "
                             "a batch of prompts of equal length)")

    @torch.no_grad()
    def prefill(self, batch) -> TargetOutput:
        if not bool(batch.attention_mask.all()):
            raise ValueError(f"HybridTarget: a hybrid model decodes one unpadded sequence (or prompts of equal "
                             f"length) at a time, got a padded batch of {batch.size}: pass the prompts one by one")
        self.cache = self.model.new_cache(batch.size, self.strategy, self.capacity)
        return self._out(self.model(batch.input_ids, self.cache), last_only=True)

    @torch.no_grad()
    def extend(self, tokens: Tensor) -> TargetOutput:
        return self._out(self.model(tokens, self.cache))

    @torch.no_grad()
    def forward(self, tokens: Tensor) -> TargetOutput:
        return self._out(self.model(tokens, self.cache, commit=False))

    def rollback(self, keep: Tensor, appended: int) -> None:
        if appended != self.cache.pending:
            raise ValueError(f"HybridTarget.rollback: {appended} tokens appended, but {self.cache.pending} are pending")
        if bool((keep != keep[0]).any()):
            raise ValueError(f"HybridTarget: rows kept different numbers of tokens ({keep.tolist()}); speculative "
                             "decoding on a hybrid model runs one unpadded sequence at a time")
        self.cache.commit(int(keep[0]))
