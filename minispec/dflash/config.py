"""The configuration of a DFlash drafter: its Qwen3-style backbone, and how it plugs into its target.

A DFlash drafter (Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv:2602.06036; reference code z-lab/dflash, `dflash/model.py`) is a small non-causal decoder that
reads the target's hidden states. Three groups of fields describe it:

* the backbone: ``hidden_size``, ``num_hidden_layers``, heads, ``head_dim``, ``intermediate_size``,
  ``layer_types`` / ``sliding_window`` (per-layer sliding-window attention), RoPE ``rope_theta``;
* the block: ``block_size`` B (one anchor token and B-1 ``mask_token_id`` tokens, drafted in one
  forward pass);
* the target: ``target_layer_ids`` (whose *outputs* are tapped: HF ``hidden_states[i + 1]``),
  ``num_target_layers``, ``target_hidden_size``, ``vocab_size``, ``final_logit_softcapping`` (Gemma
  targets cap their logits, and a drafter that uses the target's head must do the same), and
  ``has_own_lm_head`` (E4B ships its own copy of the head; the z-lab drafters share the target's).

The tap ids are data, never a formula: E4B taps ``[5, 11, 17, 23, 35]`` of 42 layers, which is not
what z-lab's default spacing would give, so every loader reads them from the config.

`read_hf_config` is the one reader of the HF-native ``config.json`` that vLLM, z-lab and SGLang load
(the cost model, the importer and the drafter loader all go through it): it resolves each layer's
attention type, window and causality, and the taps, exactly as vLLM does.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

SLIDING = "sliding_attention"
FULL = "full_attention"
ARCHITECTURE = "DFlashDraftModel"  # what an HF-native DFlash config.json names

# Gamma of the loss decay w_k = exp(-(k-1)/gamma) suggested per block size by the DFlash paper (Eq. 4,
# as SpecForge's scripts/train_dflash.py and ModelOpt's DFlash recipe quote it).
DEFAULT_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_layer_types(num_layers: int, sliding_window: int | None) -> list[str]:
    """minispec's shorthand when no ``layer_types`` are given: every layer sliding if a window is set."""
    return [SLIDING if sliding_window is not None else FULL] * num_layers


class DFlashConfig(PretrainedConfig):
    """A DFlash drafter. Build one for a target with `DFlashConfig.for_target`."""

    model_type = "minispec_dflash"

    # --- the drafter's backbone (Qwen3-style) ---
    vocab_size: int = 4096
    hidden_size: int = 192
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 3
    num_key_value_heads: int = 1
    head_dim: int = 64
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float | int = 1_000_000.0
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    layer_types: list[str] | None = None  # None: every layer sliding if sliding_window is set, else full
    sliding_window: int | None = None
    initializer_range: float = 0.02
    # --- the block ---
    block_size: int = 8
    mask_token_id: int | None = None
    # --- the target ---
    target_layer_ids: list[int] | None = None  # 0-based; the OUTPUT of each layer is tapped
    num_target_layers: int | None = None
    target_hidden_size: int | None = None
    has_own_lm_head: bool = False
    # Draft over a subset of the target's vocabulary (EAGLE-3 maps its draft head to the 32 k most frequent
    # of 128 k target tokens): the head has this many rows, the `d2t` buffer says which. None: all of it.
    draft_vocab_size: int | None = None
    final_logit_softcapping: float | int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers, self.sliding_window)
        self.layer_types = list(self.layer_types)
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        super().__post_init__(**kwargs)
        self.check()

    def check(self) -> None:
        """Raise a ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "block_size", "target_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DFlashConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one anchor and at least one mask token), got {self.block_size}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise ValueError(f"unknown layer types {unknown}; expected {SLIDING!r} or {FULL!r}")
        if SLIDING in self.layer_types:
            if not isinstance(self.sliding_window, int) or self.sliding_window < self.block_size:
                raise ValueError(f"sliding layers need sliding_window >= block_size ({self.block_size}), so that a "
                                 f"block sees all of itself; got sliding_window={self.sliding_window!r}")
        if self.draft_vocab_size is not None and not (isinstance(self.draft_vocab_size, int)
                                                       and 0 < self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be an integer in [1, vocab_size={self.vocab_size}] or None, got "
                             f"{self.draft_vocab_size!r}")
        if self.mask_token_id is None:
            raise ValueError("DFlashConfig needs mask_token_id: the token that fills the B-1 draft slots of a block "
                             "(take it from the tokenizer with mask_token_id_of(tokenizer))")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ValueError("DFlashConfig needs target_layer_ids (the target layers whose outputs are tapped); "
                             "they are read from the config, never recomputed")
        if self.num_target_layers is not None:
            check_tap_ids(self.target_layer_ids, self.num_target_layers)
        if self.has_own_lm_head is False and self.hidden_size != self.target_hidden_size:
            raise ValueError(f"a drafter that shares the target's output head needs hidden_size == target_hidden_size; "
                             f"got {self.hidden_size} and {self.target_hidden_size} (set has_own_lm_head=True)")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def window_of(self, layer: int) -> int | None:
        """The sliding window of one drafter layer, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def for_target(cls, target_config, target_layer_ids, mask_token_id: int, **kwargs) -> DFlashConfig:
        """A drafter config that fits `target_config` (an HF config): vocab, target width and depth,
        and the target's final-logit softcapping are copied from it; everything else is `kwargs`."""
        fields = dict(
            vocab_size=target_config.vocab_size,
            target_hidden_size=target_config.hidden_size,
            num_target_layers=target_config.num_hidden_layers,
            final_logit_softcapping=getattr(target_config, "final_logit_softcapping", None),
        )
        fields.update(kwargs)
        return cls(target_layer_ids=list(target_layer_ids), mask_token_id=mask_token_id, **fields)


def check_tap_ids(ids, num_target_layers: int) -> None:
    """Tap ids must name layers 0 .. N-2 of an N-layer target.

    The last layer (N-1) cannot be tapped: transformers returns `hidden_states[N]` *after* the final norm
    (not the layer's output), and vLLM captures taps as the stream entering layer i+1 inside its layer
    loop, which never reaches a layer N.
    """
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_target_layers - 2]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for a {num_target_layers}-layer target: taps must lie "
                         f"in [0, {num_target_layers - 2}] (the last layer's output is not available as a tap)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"target_layer_ids {list(ids)} repeat a layer")


# The defaults of transformers' Qwen3Config, which vLLM, z-lab and SpecForge all load a DFlash
# config.json into (its model_type is "qwen3").
QWEN3_SLIDING_WINDOW = 4096
QWEN3_MAX_WINDOW_LAYERS = 28


@dataclass(frozen=True)
class HFDFlashConfig:
    """An HF-native DFlash ``config.json``, resolved: what vLLM builds from it, layer by layer.

    ``layer_types`` / ``sliding_window`` / ``causal``: each layer's attention as vLLM runs it (the window
    is None when no layer slides). ``target_layer_ids``: DFlash semantics, the OUTPUT of layer i; None
    when the file names no taps. The other optional fields are None when the file does not state them.
    """

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_hidden_size: int
    attention_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: tuple[bool, ...]
    target_layer_ids: tuple[int, ...] | None
    num_target_layers: int | None
    block_size: int | None
    mask_token_id: int | None
    has_own_lm_head: bool | None
    has_embed_tokens: bool | None


def _draft_value(cfg: Mapping, key: str):
    """``dflash_config[key]``, falling back to the top level (as vLLM, z-lab and SGLang read it)."""
    inner = cfg.get("dflash_config") or {}
    return inner[key] if inner.get(key) is not None else cfg.get(key)


def read_hf_config(cfg: Mapping) -> HFDFlashConfig:
    """Resolve a parsed HF-native DFlash ``config.json`` (the layout z-lab publishes and vLLM serves).

    Attention, in three steps that reproduce vLLM (vllm-project/vllm,
    ``vllm/model_executor/models/qwen3_dflash.py``):

    1. transformers' ``Qwen3Config`` fills ``layer_types`` when the file has none: layer i slides iff
       ``use_sliding_window`` is true and i >= ``max_window_layers`` (default 28); and it keeps
       ``sliding_window`` (default 4096) only when ``use_sliding_window`` is true. So
       ``use_sliding_window: true`` alone leaves every layer of a drafter of up to 28 layers at full
       attention. z-lab's reference (``dflash/model.py``) stops here.
    2. vLLM's ``_resolve_layer_attention``: ``dflash_config.use_swa`` makes every layer slide when
       none does; the window is ``dflash_config.swa_window_size``, else the ``sliding_window`` of step 1.
    3. vLLM's ``_dflash_layer_causal``: a layer is causal if the top-level ``is_causal`` says so, else
       if ``dflash_config.causal`` does, else iff step 1 made it sliding (z-lab's default too). A
       non-causal SWA drafter must therefore state ``causal: false``.

    Taps: vLLM's ``eagle_aux_hidden_state_layer_ids`` count the INPUT of layer i, so they are the
    DFlash ids + 1 (``eagle3_utils.get_eagle3_aux_layers_from_config`` prefers them, else takes
    ``dflash_config.target_layer_ids``, else the top-level ``target_layer_ids``). They are checked
    against ``num_target_layers`` when the file gives it.
    """
    if not isinstance(cfg, Mapping):
        raise ValueError(f"a DFlash config must be a mapping (a parsed config.json), got {type(cfg).__name__}")
    dflash = cfg.get("dflash_config") or {}
    if not isinstance(dflash, Mapping):
        raise ValueError(f"dflash_config must be a mapping, got {type(dflash).__name__}")

    def need(key: str):
        if cfg.get(key) is None:
            raise ValueError(f"the DFlash config lacks {key!r}")
        return cfg[key]

    layers, hidden, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}); "
                             f"give head_dim")
        head_dim = hidden // heads

    # 1. What transformers' Qwen3Config makes of the file.
    window = cfg.get("sliding_window", QWEN3_SLIDING_WINDOW) if cfg.get("use_sliding_window") else None
    loaded = cfg.get("layer_types")
    if loaded is None:
        first = cfg.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS)
        loaded = [SLIDING if window is not None and i >= first else FULL for i in range(layers)]
    loaded = tuple(loaded)
    if len(loaded) != layers:
        raise ValueError(f"layer_types has {len(loaded)} entries for {layers} layers")
    # 2. vLLM's use_swa and swa_window_size.
    layer_types = (SLIDING,) * layers if dflash.get("use_swa") and SLIDING not in loaded else loaded
    window = dflash.get("swa_window_size", window) if SLIDING in layer_types else None
    if SLIDING in layer_types and window is None:
        raise ValueError("the DFlash config has sliding layers but no window: give dflash_config.swa_window_size, "
                         "or sliding_window with use_sliding_window: true")
    # 3. vLLM's causality.
    stated = cfg.get("is_causal")
    if stated is None:
        stated = dflash.get("causal")
    causal = tuple(bool(stated) if stated is not None else kind == SLIDING for kind in loaded)

    num_target_layers = _draft_value(cfg, "num_target_layers")
    ids = _draft_value(cfg, "target_layer_ids")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if aux:
        from_aux = [i - 1 for i in aux]
        if ids is not None and list(ids) != from_aux:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(aux)} (input of layer i) disagree with "
                             f"target_layer_ids {list(ids)} (output of layer i): they must be the ids + 1")
        ids = from_aux
    if ids is not None:
        ids = tuple(ids)
        if not ids:
            raise ValueError("target_layer_ids is empty: a DFlash drafter needs at least one tap")
        if num_target_layers is not None:
            check_tap_ids(ids, num_target_layers)

    top_block, inner_block = cfg.get("block_size"), dflash.get("block_size")
    if top_block is not None and inner_block is not None and top_block != inner_block:
        raise ValueError(f"block_size {top_block} at the top level but {inner_block} in dflash_config")

    return HFDFlashConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=need("intermediate_size"), vocab_size=need("vocab_size"),
        target_hidden_size=cfg.get("target_hidden_size") or hidden,
        attention_bias=bool(cfg.get("attention_bias", False)),
        layer_types=layer_types, sliding_window=window, causal=causal,
        target_layer_ids=ids, num_target_layers=num_target_layers,
        block_size=inner_block if inner_block is not None else top_block,
        mask_token_id=_draft_value(cfg, "mask_token_id"),
        has_own_lm_head=cfg.get("has_own_lm_head", cfg.get("has_lm_head")),
        has_embed_tokens=cfg.get("has_embed_tokens"),
    )


def config_from_hf_dflash(cfg: dict, has_lm_head: bool, target_config=None,
                          draft_vocab_size: int | None = None) -> DFlashConfig:
    """A `DFlashConfig` from an HF-native `config.json` (parsed), resolved as vLLM resolves it (`read_hf_config`).

    has_lm_head: whether the weights hold `lm_head.weight`; draft_vocab_size: the length of their `d2t`, if
    any (it must agree with the config's). target_config fills what the file may
    lack (num_target_layers, final_logit_softcapping) and is checked against what it states.
    """
    if ARCHITECTURE not in (cfg.get("architectures") or []):
        raise ValueError(f"not a DFlash drafter config: architectures is {cfg.get('architectures')!r}, expected "
                         f"[{ARCHITECTURE!r}]")
    hf = read_hf_config(cfg)
    if hf.block_size is None:
        raise ValueError("the DFlash config gives no block_size")
    if hf.target_layer_ids is None:
        raise ValueError("the DFlash config gives no target_layer_ids; they are never recomputed")
    causal = [i for i, c in enumerate(hf.causal) if c]
    if causal:
        raise ValueError(f"layers {causal} of this DFlash drafter are causal (is_causal or dflash_config.causal, or "
                         f"sliding layers without dflash_config.causal: false, which vLLM runs causally); minispec's "
                         f"drafter attends non-causally within a block")
    num_target_layers = hf.num_target_layers
    softcap = cfg.get("final_logit_softcapping")
    if target_config is not None:
        if num_target_layers is None:
            num_target_layers = target_config.num_hidden_layers
        if "final_logit_softcapping" not in cfg:
            softcap = getattr(target_config, "final_logit_softcapping", None)
    rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    stated = cfg.get("draft_vocab_size")
    if stated is not None and stated != draft_vocab_size and not (draft_vocab_size is None and stated == hf.vocab_size):
        raise ValueError(f"the config's draft_vocab_size is {stated} but the weights' d2t maps "
                         f"{draft_vocab_size or 'no'} draft tokens")
    return DFlashConfig(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads, head_dim=hf.head_dim,
        hidden_act=cfg.get("hidden_act", "silu"), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096), attention_bias=hf.attention_bias,
        layer_types=list(hf.layer_types), sliding_window=hf.sliding_window,
        block_size=hf.block_size, mask_token_id=hf.mask_token_id, target_layer_ids=list(hf.target_layer_ids),
        num_target_layers=num_target_layers, target_hidden_size=hf.target_hidden_size,
        has_own_lm_head=has_lm_head, final_logit_softcapping=softcap, draft_vocab_size=draft_vocab_size,
    )


def is_dflash_folder(folder) -> bool:
    """A DFlash drafter folder, minispec's own (`save_pretrained`) or exported HF-native (vLLM / z-lab)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return "DFlashDraftModel" in config.get("architectures", []) or "dflash_config" in config


def mask_token_id_of(tokenizer) -> int:
    """The id of the tokenizer's `<mask>` token; a clear error if it has none (DFlash needs one)."""
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        mask_id = vocab.get("<mask>")
    if mask_id is None:
        raise ValueError("the tokenizer has no <mask> token: DFlash fills the draft slots of each block with a mask "
                         "token that must exist in the target's vocabulary (add one, e.g. mask_token='<mask>')")
    return int(mask_id)


def bolt_mini_dflash_config(**overrides) -> DFlashConfig:
    """The DFlash drafter for bolt-mini, mirroring Bolt E4B's drafter at toy scale.

    bolt-mini is a 12-layer Gemma-4 whose layers 5 and 11 are full attention (5 sliding + 1 full).
    The taps are this project's choice. E4B's drafter reads five of its target's seven full-attention
    layers (5, 11, 17, 23 and 35 of 5, 11, ..., 41; the Bolt E4B write-up gives no reason for leaving
    out 29 and 41). bolt-mini's layer 11 is its last, whose output is not available as a tap
    (`check_tap_ids`), so full layers alone would give one tap: the drafter reads full layer 5 and
    sliding layers 8 and 10, three taps over the later half of the stack as E4B's span 5 to 35.

    * B = 8 (E4B's block size; 7 drafts per cycle), gamma = 4 for the loss decay;
    * 2 layers of hidden 192 with bolt-mini's heads (3 q / 1 kv of 64) and an MLP of 2 x hidden (E4B's
      ratio); every layer sliding, as every E4B drafter layer slides (over 1,024 tokens), with
      bolt-mini's own 128-token window (the project's choice of width);
    * the head is shared with the target (bolt-mini ties it to its embedding). An own head would be
      4096 x 192 = 786k parameters, more than the rest of the drafter (~751k) and the largest thing to
      learn on a CPU budget; sharing keeps the drafter's outputs in the target's own output space.
      `has_own_lm_head=True` gives E4B's layout (initialised as a copy of the target's head).
    """
    from minispec.targets.configs import bolt_mini_config
    from minispec.targets.tokenizer import SPECIAL_TOKENS

    target = bolt_mini_config()
    fields = dict(
        target_layer_ids=[5, 8, 10],
        mask_token_id=SPECIAL_TOKENS.index("<mask>"),
        hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=target.head_dim,
        sliding_window=target.sliding_window,
        max_position_embeddings=target.max_position_embeddings,
        block_size=8,
    )
    fields.update(overrides)
    return DFlashConfig.for_target(target, **fields)


def smollm2_dflash_config(**overrides) -> DFlashConfig:
    """The DFlash drafter for SmolLM2-135M-Instruct (30 Llama layers, hidden 576, 9 q / 3 kv heads of 64).

    * taps: five layers spread over the 30 as z-lab's `build_target_layer_ids` spaces them (from layer 1
      to layer N - 3): [1, 7, 14, 20, 27];
    * one layer of the target's own width and heads, full attention like the target; B = 8 (E4B's
      block size, 7 drafts per cycle);
    * the head is the target's tied embedding (shared, as z-lab's drafters share it), by default
      restricted to a draft vocabulary (`draft_vocab_size`) of the most frequent reply tokens;
    * the mask token is `<empty_output>` (id 16), a special token a chat reply never contains.
    """
    fields = dict(target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=16, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  rms_norm_eps=1e-5, rope_theta=100_000.0, max_position_embeddings=8192, block_size=8)
    fields.update(overrides)
    return DFlashConfig(vocab_size=49_152, target_hidden_size=576, num_target_layers=30, **fields)
