"""The DFlash drafter: taps, shared embedding and head, training = inference, the drafter in the loop.

Public DFlash re-implementations were sunk by five train/inference mismatches, M1-M5 below (found in
SpecForge #427 and #455 -> #473). The ones that live in this code each get a check that passes on the
real code and fails when the bug is injected on purpose:

    mask: causal block (M1), context `<=` anchor (M3), blocks leaking into each other (M4),
          padding blocks not isolated (M5)          -> test_each_injected_mismatch_breaks_equality
    positions (block positions off by one)          -> test_each_injected_mismatch_breaks_equality
    label alignment: labels shifted by +1 (M2)      -> test_labels_are_what_verification_checks
    embedding scaling / shared head (Gemma)         -> test_embedding_..., test_shared_head_...
    tap indexing (output vs input of layer i)       -> test_taps_are_the_outputs_of_the_tapped_layers

Models are tiny and random (tests/tiny.py); exactness of the loop does not depend on acceptance.
"""
import pytest
import torch
import torch.nn.functional as F

import minispec as ms
from minispec.costs import dflash_kv_cache_bytes, dflash_param_count
from minispec.dflash import mask as dm
from minispec.dflash.config import (
    FULL,
    SLIDING,
    DFlashConfig,
    bolt_mini_dflash_config,
    config_from_hf_dflash,
    mask_token_id_of,
)
from minispec.dflash.drafter import DFlashDrafter
from minispec.dflash.export import hf_dflash_config
from minispec.dflash.model import DFlashDraftModel, num_parameters
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.drafter import Proposal, Sampling
from minispec.speculative.target import HFTarget
from minispec.targets.load import CHECKPOINTS
from tiny import assert_same_as_ar, tiny_gemma

MASK_ID = 3


@pytest.fixture(scope="module")
def target():
    return tiny_gemma(layers=6, window=16, seed=0)  # layers 0-4 sliding, 5 full


def small_config(target, **kw):
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, layer_types=[SLIDING, FULL], sliding_window=10, block_size=8,
                  initializer_range=0.2)  # large random weights: every mask entry moves the logits visibly
    fields.update(kw)
    return DFlashConfig.for_target(target.config, fields.pop("taps", [1, 3, 4]), MASK_ID, **fields)


def drafter_model(target, seed=1, **kw):
    torch.manual_seed(seed)
    return DFlashDraftModel.for_target(small_config(target, **kw), target).eval()


def sequence(target, S=40, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 4096, (batch, S), generator=g)
    with torch.no_grad():
        return ids, target(ids, output_hidden_states=True)


# --- taps, embedding, head -------------------------------------------------------------------------

def layer_outputs(target, ids, layers):
    """The outputs of target layers, caught by forward hooks: ground truth for the taps."""
    caught, handles = {}, []
    for i in layers:
        def hook(mod, args, out, i=i):
            caught[i] = out[0] if isinstance(out, tuple) else out

        handles.append(target.model.layers[i].register_forward_hook(hook))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    for h in handles:
        h.remove()
    return out.hidden_states, torch.cat([caught[i] for i in layers], dim=-1)


def test_taps_are_the_outputs_of_the_tapped_layers(target):
    model = drafter_model(target)
    ids, _ = sequence(target, S=12, batch=1)
    hidden_states, truth = layer_outputs(target, ids, [1, 3, 4])
    assert torch.equal(model.tap(hidden_states), truth)
    # Injected: vLLM's "input of layer i" convention (hidden_states[i]) in DFlash's place.
    off_by_one = torch.cat([hidden_states[i] for i in [1, 3, 4]], dim=-1)
    assert not torch.allclose(off_by_one, truth, atol=1e-3)


def test_embedding_is_the_targets_scaled_embedding(target):
    model = drafter_model(target)
    ids, out = sequence(target, S=12, batch=1)
    assert torch.equal(model.embed(ids), out.hidden_states[0])  # what the target's first layer reads
    # Injected: looking the rows up without Gemma's sqrt(hidden) scale (vLLM PR #41703).
    unscaled = F.embedding(ids, target.get_input_embeddings().weight)
    assert not torch.allclose(unscaled, out.hidden_states[0], atol=1e-3)
    assert torch.allclose(unscaled * target.config.hidden_size ** 0.5, out.hidden_states[0], atol=1e-5)


def test_shared_head_is_the_targets_head_with_softcapping():
    target = tiny_gemma(layers=6, window=16, seed=2)
    with torch.no_grad():
        target.model.norm.weight.mul_(50.0)  # logits of order 30: the softcap matters
    ids, out = sequence(target, S=6, batch=1)
    final = out.hidden_states[-1]  # transformers returns the final-normed state here, what the head reads
    for own_head in (False, True):
        model = DFlashDraftModel.for_target(small_config(target, has_own_lm_head=own_head), target)
        assert torch.allclose(model.output_logits(final), out.logits, atol=1e-5, rtol=0)
    # Injected: the shared head without the target's final-logit softcapping.
    assert not torch.allclose(F.linear(final, target.lm_head.weight), out.logits, atol=1e-1)


def test_draft_head_is_gathered_once_and_again_when_head_or_vocabulary_change():
    """At inference the shared head's draft-vocabulary rows are kept between drafts; changing the target's head
    in place, or the draft vocabulary, gathers them again; with gradients on they are gathered every call,
    so gradients reach the head."""
    target = tiny_gemma(layers=6, window=16, seed=2)
    model = DFlashDraftModel.for_target(small_config(target, draft_vocab_size=64), target)
    model.set_draft_vocab(torch.arange(4, 68))
    head = target.get_output_embeddings().weight

    def expected():
        return head.detach()[model.draft_vocab()]

    with torch.no_grad():
        first = model.head_weight()
        assert torch.equal(first, expected()) and model.head_weight() is first  # kept
        head.mul_(2.0)
        assert torch.equal(model.head_weight(), expected())  # the head changed in place: gathered again
        model.set_draft_vocab(torch.arange(100, 164))
        assert torch.equal(model.head_weight(), expected())  # another vocabulary
    head.requires_grad_(True)
    model.output_logits(torch.randn(3, 64)).sum().backward()
    assert head.grad is not None and head.grad[100:164].abs().sum() > 0 and head.grad[:100].abs().sum() == 0


# --- training mode = inference mode -------------------------------------------------------------------

def training_blocks(ids, num_anchors=5, T=8, seed=0, pad_last=True):
    anchors, valid = dm.sample_anchors(torch.ones_like(ids), T, num_anchors, torch.Generator().manual_seed(seed))
    if pad_last:
        valid[-1, -1] = False  # one padding block
    return dm.make_blocks(ids, anchors, valid, T, MASK_ID, gamma=None if T == 8 else 2.0)


def inference_logits(model, features, blocks):
    """Each valid block drafted the inference way: a cache of the context before its anchor, then draft()."""
    out = torch.zeros(*blocks.input_ids.shape, model.config.vocab_size)
    for b, j in blocks.valid.nonzero().tolist():
        a = int(blocks.anchors[b, j])
        cache = model.new_cache(1)
        model.extend_cache(cache, features[b:b + 1, :a], torch.ones(1, a, dtype=torch.bool))
        out[b, j] = model.draft(blocks.input_ids[b:b + 1, j], cache)[0]
    return out


@pytest.mark.parametrize("layer_types,window", [([SLIDING, FULL], 10), ([FULL, FULL], None), ([SLIDING], 8)])
def test_training_logits_equal_inference_logits(target, layer_types, window):
    model = drafter_model(target, layer_types=layer_types, num_hidden_layers=len(layer_types), sliding_window=window)
    ids, out = sequence(target, S=40)
    features = model.tap(out.hidden_states)
    blocks = training_blocks(ids)
    with torch.no_grad():
        train = model(features, blocks)
        infer = inference_logits(model, features, blocks)
    v = blocks.valid
    assert v.sum() >= 8
    assert torch.allclose(train[v], infer[v], atol=1e-5, rtol=0), (train[v] - infer[v]).abs().max()


def inject(allow, blocks, S, T, bug):
    """The training mask of every layer type with one known bug built in."""
    Q = blocks.anchors.shape[1] * T
    q = torch.arange(Q)
    anchor = blocks.anchors[:, q // T]  # [Bs, Q]
    same_block = (q[:, None] // T) == (q[None, :] // T)
    valid_q = blocks.valid[:, q // T]
    valid_k = blocks.valid[:, q // T]
    wrong = {}
    for kind, m in allow.items():
        m = m.clone()
        if bug == "causal block":  # 1: a block query sees only its own and earlier block positions
            m[:, :, S:] &= (q[None, :] <= q[:, None])
        elif bug == "context <= anchor":  # 3: the anchor's own features leak in
            at_anchor = torch.arange(S)[None, None, :] == anchor[:, :, None]
            m[:, :, :S] |= at_anchor & valid_q[:, :, None]
        elif bug == "cross-block leak":  # 4: blocks see each other's (future) keys
            m[:, :, S:] |= (~same_block)[None] & valid_q[:, :, None] & valid_k[:, None, :]
        elif bug == "padding not isolated":  # 5: real blocks see a padding block's keys
            m[:, :, S:] |= (~same_block)[None] & valid_q[:, :, None] & ~valid_k[:, None, :]
        wrong[kind] = m
    return wrong


@pytest.mark.parametrize("bug", ["causal block", "context <= anchor", "cross-block leak", "padding not isolated",
                                 "block positions + 1"])
def test_each_injected_mismatch_breaks_equality(target, bug):
    model = drafter_model(target)
    ids, out = sequence(target, S=40)
    features = model.tap(out.hidden_states)
    blocks = training_blocks(ids)
    S, T = ids.shape[1], 8
    allow = model.training_masks(blocks, S)
    positions = blocks.positions
    if bug == "block positions + 1":
        positions = positions + 1
    else:
        allow = inject(allow, blocks, S, T, bug)
    with torch.no_grad():
        train = model.forward_blocks(blocks.input_ids.flatten(1), positions.flatten(1), features, allow)
        infer = inference_logits(model, features, blocks)
    v = blocks.valid
    diff = (train.unflatten(1, (-1, T))[v] - infer[v]).abs().max()
    assert diff > 1e-2, f"{bug}: training and inference agree ({diff}), the check would miss this bug"


def test_labels_are_what_verification_checks():
    """Block position k is verified against the target's token at position anchor + k, so it must be
    trained on x[a + k]. An oracle that outputs the target's own prediction for each position is 100%
    right under the real labels, and almost never under labels shifted by one (M2)."""
    target = tiny_gemma(layers=4, window=16, seed=3, dtype=torch.float64)  # float64: no argmax ties
    prompt = torch.randint(4, 4096, (1, 6), generator=torch.Generator().manual_seed(4))
    x = torch.cat([prompt, ms.autoregressive_generate(target, prompt, 40).tokens], dim=1)  # greedy text
    with torch.no_grad():
        predicted = target(x).logits  # predicted[t] = the target's distribution for x[t + 1]
    T = 8
    loss_mask = torch.zeros_like(x)
    loss_mask[:, 6:] = 1  # the generated part
    anchors, valid = dm.sample_anchors(loss_mask, T, 6, torch.Generator().manual_seed(5))
    blocks = dm.make_blocks(x, anchors, valid, T, MASK_ID, loss_mask)
    oracle = predicted[0, (blocks.positions - 1).clamp(min=0)]  # block position k -> prediction of x[a + k]
    assert dm.weighted_accuracy(oracle, blocks.labels, blocks.weights) == 1.0
    shifted = x.roll(-1, dims=1).gather(1, blocks.positions.flatten(1).clamp(max=x.shape[1] - 1)).view_as(blocks.labels)
    assert dm.weighted_accuracy(oracle, shifted, blocks.weights) < 0.2

    # And the drafter proposes block position k as draft d_k (the anchor is position 0).
    tgt = tiny_gemma(layers=6, window=16, seed=0)
    drafter = DFlashDrafter(drafter_model(tgt), tgt)
    fake = torch.full((1, T, 4096), -1.0)
    fake[0, torch.arange(T), 1000 + torch.arange(T)] = 1.0  # block position k says token 1000 + k
    drafter.model.draft = lambda block, cache: fake
    proposal = drafter.propose(torch.tensor([5]), 7, Sampling(), None)
    assert proposal.tokens.tolist() == [[1001, 1002, 1003, 1004, 1005, 1006, 1007]] and proposal.q is None


# --- the drafter in the speculative loop --------------------------------------------------------------

def ragged_prompts(seed=0):
    """Prompts longer than the target's 16-token window and the drafter's 10-token window."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 4096, (n,), generator=g) for n in (41, 23, 57)]


def test_greedy_dflash_equals_ar_ragged_and_past_the_window(target):
    prompts = ragged_prompts()
    spec = assert_same_as_ar(target, DFlashDrafter(drafter_model(target), target), prompts, 30)
    assert spec.stats.max_proposed == 7 and spec.stats.tau >= 1.0
    assert_same_as_ar(target, DFlashDrafter(drafter_model(target, seed=2), target, num_draft_tokens=3), prompts[1:], 20)


class RecordingDrafter(DFlashDrafter):
    """Remembers every `last` and every commit, to rebuild what each row has really committed.
    With commit_all (an injected bug), the rejected drafts' features enter the draft cache too."""

    commit_all = False

    def begin(self, batch, target_out):
        self.stream = [row[m.bool()].tolist() for row, m in zip(batch.input_ids, batch.attention_mask)]
        super().begin(batch, target_out)

    def propose(self, last, k, sampling, generator=None):
        self._last = last.tolist()
        return super().propose(last, k, sampling, generator)

    def commit(self, accepted, tokens, target_out):
        for b, a in enumerate(accepted.tolist()):
            self.stream[b] += [self._last[b]] + tokens[b, :a].tolist()
        if self.commit_all:
            accepted = torch.full_like(accepted, tokens.shape[1] - 1)
        super().commit(accepted, tokens, target_out)


class OracleDrafter(RecordingDrafter):
    """Runs the real DFlash forward, then proposes the target's own greedy continuation, made wrong
    from a random position on: every acceptance length 0..K occurs, so commits keep ragged prefixes."""

    def __init__(self, model, target, prompts, future, seed=0):
        super().__init__(model, target)
        self.prompt_lens = [len(p) for p in prompts]
        self.future, self.g = future, torch.Generator().manual_seed(seed)

    def propose(self, last, k, sampling, generator=None):
        proposal = super().propose(last, k, sampling, generator)
        tokens = proposal.tokens.clone()
        for b in range(len(last)):
            emitted = len(self.stream[b]) - self.prompt_lens[b] + 1  # `last` is emitted already
            truth = self.future[b][emitted: emitted + k]
            right = min(int(torch.randint(0, k + 1, (1,), generator=self.g)), len(truth))
            tokens[b, :right] = torch.tensor(truth[:right], dtype=torch.long)
            if right < k:
                wrong = truth[right] + 1 if right < len(truth) else 5
                tokens[b, right] = wrong % 4096
        return Proposal(tokens, None)


@pytest.mark.parametrize("commit_all", [False, True], ids=["accepted only", "injected: every draft"])
def test_draft_cache_holds_only_committed_context(target, commit_all):
    """After generation with every acceptance length, the draft cache equals one built in a single
    prefill over what was committed; committing the rejected drafts' features too breaks that."""
    prompts = ragged_prompts(seed=1)
    future = ms.autoregressive_generate(target, prompts, 60).tokens.tolist()
    drafter = OracleDrafter(drafter_model(target), target, prompts, future)
    drafter.commit_all = commit_all
    spec = assert_same_as_ar(target, drafter, prompts, 25)
    assert {c.accepted for c in spec.stats.verifications} >= {0, 3, 7}
    fresh = DFlashDrafter(drafter.model, target)
    batch = as_prompt_batch([torch.tensor(s) for s in drafter.stream], 0)
    fresh.begin(batch, HFTarget(target, output_hidden_states=True).prefill(batch))
    same_layout = torch.equal(drafter.cache.seen, fresh.cache.seen) and all(
        torch.equal(a, b) for a, b in zip(drafter.cache.lengths, fresh.cache.lengths))
    assert same_layout != commit_all
    if commit_all:
        return
    for ours, theirs, n in zip(drafter.cache.keys + drafter.cache.values, fresh.cache.keys + fresh.cache.values,
                               drafter.cache.lengths * 2):
        for b in range(len(prompts)):
            assert torch.allclose(ours[b, :n[b]], theirs[b, :n[b]], atol=1e-4)
    # Sliding layers hold the last W-1 = 9 positions, the full layer every committed one.
    assert drafter.cache.lengths[0].tolist() == [9, 9, 9]
    assert drafter.cache.lengths[1].tolist() == [len(s) for s in drafter.stream]


def test_drafts_are_argmax_at_any_temperature(target):
    drafter = DFlashDrafter(drafter_model(target), target)

    def run(seed):
        return ms.speculative_generate(target, drafter, ragged_prompts(), 12, temperature=1.0, top_k=50,
                                       generator=torch.Generator().manual_seed(seed)).tokens

    assert torch.equal(run(3), run(3))
    proposal = drafter.propose(torch.tensor([5, 6, 7]), 7, Sampling(1.0), torch.Generator())
    assert proposal.q is None  # one-hot: verification accepts d_k with probability p_k(d_k)
    assert torch.equal(proposal.tokens, drafter.last_logits[:, 1:].argmax(-1))


# --- cost model ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"has_own_lm_head": True}, {"attention_bias": True, "taps": [0, 2]},
                                {"hidden_size": 48, "has_own_lm_head": True, "num_hidden_layers": 1,
                                 "layer_types": [FULL], "sliding_window": None}])
def test_parameter_count_equals_the_cost_model(target, kw):
    model = drafter_model(target, **kw)
    read_back = config_from_hf_dflash(hf_dflash_config(model.config), has_lm_head=model.config.has_own_lm_head)
    assert num_parameters(model) == dflash_param_count(model.config).total == dflash_param_count(read_back).total


def test_cache_payload_equals_the_cost_model_below_the_window(target):
    model = drafter_model(target, layer_types=[FULL, FULL], sliding_window=None)
    shape = config_from_hf_dflash(hf_dflash_config(model.config), has_lm_head=False)
    _, out = sequence(target, S=30, batch=1)
    cache = model.new_cache(1)
    model.extend_cache(cache, model.tap(out.hidden_states), torch.ones(1, 30, dtype=torch.bool))
    assert cache.nbytes() == dflash_kv_cache_bytes(shape, 30, bytes_per_element=4)


# --- save / load, the shipped config, bad input ---------------------------------------------------------

def test_save_pretrained_round_trip(target, tmp_path):
    model = drafter_model(target, has_own_lm_head=True)
    model.save_pretrained(tmp_path)
    again = DFlashDraftModel.from_pretrained(tmp_path)
    assert again.config.target_layer_ids == [1, 3, 4] and again.config.layer_types == [SLIDING, FULL]
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    from transformers import AutoModel

    assert isinstance(AutoModel.from_pretrained(tmp_path), DFlashDraftModel)
    drafter = DFlashDrafter.from_pretrained(tmp_path, target)
    prompts = ragged_prompts()[:2]
    a = ms.speculative_generate(target, DFlashDrafter(model, target), prompts, 10)
    b = ms.speculative_generate(target, drafter, prompts, 10)
    assert [c.tokens for c in a.stats.cycles] == [c.tokens for c in b.stats.cycles]  # same drafts, same fates


def test_bolt_mini_config_taps_full_attention_and_late_layers():
    from minispec.targets.configs import bolt_mini_config

    cfg, target_cfg = bolt_mini_dflash_config(), bolt_mini_config()
    folder = CHECKPOINTS / "bolt-mini"
    if (folder / "config.json").exists():  # the shipped target, when it has been built
        from transformers import AutoConfig

        target_cfg = AutoConfig.from_pretrained(folder)
    full = [i for i, t in enumerate(target_cfg.layer_types) if t == FULL]
    assert full == [5, 11]
    assert cfg.target_layer_ids == [5, 8, 10]  # full layer 5, late layers 8 and 10; 11 is the last layer
    assert cfg.num_target_layers == target_cfg.num_hidden_layers == 12
    assert cfg.block_size == 8 and cfg.mask_token_id == 3 and not cfg.has_own_lm_head
    assert cfg.hidden_size == cfg.target_hidden_size == target_cfg.hidden_size
    assert cfg.final_logit_softcapping == target_cfg.final_logit_softcapping
    assert set(cfg.layer_types) == {SLIDING} and cfg.sliding_window == target_cfg.sliding_window
    assert dm.decay_weights(cfg.block_size)[2] == pytest.approx(torch.exp(torch.tensor(-0.25)).item())


def test_bad_input_says_what_is_wrong(target):
    model = drafter_model(target)
    with pytest.raises(ValueError, match=r"target_layer_ids \[5\] out of range for a 6-layer target"):
        small_config(target, taps=[1, 5])  # layer 5 is the last layer
    with pytest.raises(ValueError, match=r"target_layer_ids \[-1\] out of range"):
        small_config(target, taps=[-1, 2])
    four = tiny_gemma(layers=4, window=16)
    with pytest.raises(ValueError, match="built for a 6-layer target, this target has 4 layers"):
        DFlashDrafter(model, four)
    unknown_depth = drafter_model(target, num_target_layers=None)
    with pytest.raises(ValueError, match=r"target_layer_ids \[3, 4\] out of range for a 4-layer target"):
        unknown_depth.attach_target(four)
    wide = DFlashConfig.for_target(target.config, [1], MASK_ID, target_hidden_size=32, hidden_size=32,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64)
    with pytest.raises(ValueError, match="target hidden size 32 .* the target's hidden size is 64"):
        DFlashDraftModel(wide).attach_target(target)
    with pytest.raises(ValueError, match="drafter vocab size 5000 != target vocab size 4096"):
        DFlashDraftModel(small_config(target, vocab_size=5000)).attach_target(target)
    with pytest.raises(ValueError, match="final_logit_softcapping=None but the target uses 30.0"):
        DFlashDraftModel(small_config(target, final_logit_softcapping=None)).attach_target(target)
    with pytest.raises(ValueError, match="block_size 16 differs from the drafter's config"):
        DFlashDrafter(model, target, block_size=16)
    with pytest.raises(ValueError, match="block of 8 positions drafts 1 to 7 tokens"):
        ms.speculative_generate(target, DFlashDrafter(model, target), ragged_prompts()[:1], 4, num_draft_tokens=8)
    with pytest.raises(ValueError, match="blocks have 4 positions but the drafter's block_size is 8"):
        ids, out = sequence(target, S=20, batch=1)
        model(model.tap(out.hidden_states), training_blocks(ids, T=4, pad_last=False))
    with pytest.raises(RuntimeError, match="no target attached"):
        DFlashDraftModel(model.config).embed(torch.tensor([1]))
    with pytest.raises(ValueError, match="shares the target's output head needs hidden_size == target_hidden_size"):
        small_config(target, hidden_size=32)
    with pytest.raises(ValueError, match="needs mask_token_id"):
        DFlashConfig(target_layer_ids=[1])
    with pytest.raises(ValueError, match="sliding_window >= block_size"):
        small_config(target, sliding_window=4)


def test_mask_token_comes_from_the_tokenizer():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")
    assert mask_token_id_of(tok) == MASK_ID
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    bare.mask_token = None
    vocab = bare.get_vocab()
    if "<mask>" in vocab:  # the same vocabulary still names the token: drop it from the lookup too
        bare.get_vocab = lambda: {k: v for k, v in vocab.items() if k != "<mask>"}
    with pytest.raises(ValueError, match="tokenizer has no <mask> token"):
        mask_token_id_of(bare)


@pytest.mark.skipif(not (CHECKPOINTS / "bolt-mini" / "config.json").exists(),
                    reason="bolt-mini is not built (python -m minispec.targets.train bolt-mini)")
def test_bolt_mini_drafter_on_the_shipped_target():
    """The shipped target: the taps are layers 5, 8, 10's outputs, and a (random) drafter is exact."""
    bolt, _ = ms.load_target("bolt-mini")
    torch.manual_seed(0)
    model = DFlashDraftModel.for_target(bolt_mini_dflash_config(), bolt)
    prompts = ms.load_evalset().prompts[:2]
    hidden_states, truth = layer_outputs(bolt, prompts[0][None, :40], [5, 8, 10])
    assert torch.equal(model.tap(hidden_states), truth)
    assert_same_as_ar(bolt, DFlashDrafter(model, bolt), [p[:150] for p in prompts], 16)
