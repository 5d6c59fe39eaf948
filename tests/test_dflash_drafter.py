"""The DFlash drafter's two drafting policies: both exact, greedy and sampled, with a full or a reduced
draft vocabulary; sampled drafts come with the q they were drawn from, in the target's vocabulary.

Exactness at T = 1 is tested as tests/test_verify.py tests the verifier: a chi-square goodness of fit of
the first emitted tokens against the target's own distribution (its `chi_square_p_value`, the same
thresholds), on a target small enough (V = 8) for every 3-token prefix to be a cell, and the same test
must reject a drafter that sends the verifier a q it did not sample from.
"""
import pytest
import torch
from test_verify import ALPHA_BROKEN, ALPHA_PASS, chi_square_p_value
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

import minispec as ms
from minispec.dflash.config import FULL, SLIDING, DFlashConfig
from minispec.dflash.drafter import POLICIES, DFlashDrafter
from minispec.dflash.model import DFlashDraftModel
from minispec.speculative import sampling as smp
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.drafter import Proposal, Sampling
from minispec.speculative.target import HFTarget
from tiny import assert_same_as_ar, tiny_gemma

MASK_ID = 3


@pytest.fixture(scope="module")
def target():
    return tiny_gemma(layers=6, window=16, seed=0)  # layers 0-4 sliding, 5 full


def drafter_model(target, seed=1, draft_vocab: torch.Tensor | None = None, **kw) -> DFlashDraftModel:
    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, layer_types=[SLIDING, FULL], sliding_window=10, block_size=8,
                  initializer_range=0.2, draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    fields.update(kw)
    torch.manual_seed(seed)
    model = DFlashDraftModel.for_target(DFlashConfig.for_target(target.config, [1, 3, 4], MASK_ID, **fields), target)
    if draft_vocab is not None:
        model.set_draft_vocab(draft_vocab)
    return model.eval()


def ragged_prompts(seed=0):
    """Prompts longer than the target's 16-token window and the drafter's 10-token window."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 4096, (n,), generator=g) for n in (41, 23, 57)]


def reduced_vocab(n=512, seed=0):
    return torch.randperm(4096, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_greedy_output_equals_ar_with_either_policy(target, policy, vocab):
    model = drafter_model(target, draft_vocab=reduced_vocab() if vocab == "reduced" else None)
    spec = assert_same_as_ar(target, DFlashDrafter(model, target, policy=policy), ragged_prompts(), 24)
    assert spec.stats.max_proposed == 7


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=40, top_p=0.9)], ids=["T=1", "top-k-p"])
def test_sampled_q_is_a_distribution_over_the_draft_vocabulary(target, sampling):
    vocab = reduced_vocab(n=64)
    drafter = DFlashDrafter(drafter_model(target, draft_vocab=vocab), target, policy="sample")
    batch = as_prompt_batch(ragged_prompts(), 0)
    drafter.begin(batch, HFTarget(target, output_hidden_states=True).prefill(batch))
    prop = drafter.propose(torch.tensor([5, 6, 7]), 5, sampling, torch.Generator().manual_seed(0))
    assert prop.q.shape == (3, 5, 4096) and prop.tokens.shape == (3, 5)
    assert torch.allclose(prop.q.sum(-1), torch.ones(3, 5), atol=1e-5)
    outside = torch.ones(4096, dtype=torch.bool)
    outside[vocab] = False
    assert (prop.q[..., outside] == 0).all()
    assert torch.isin(prop.tokens, vocab).all()
    assert (prop.q.gather(-1, prop.tokens[..., None]) > 0).all()
    # q is what `sampling_probs` makes of the drafter's own logits, scattered into the target's ids
    expected = smp.sampling_probs(drafter.last_logits[:, 1:6], sampling.temperature, sampling.top_k, sampling.top_p)
    assert torch.equal(prop.q[..., vocab.sort().values], expected)


def test_argmax_drafts_are_target_ids_of_the_draft_argmax(target):
    vocab = reduced_vocab(n=64)
    drafter = DFlashDrafter(drafter_model(target, draft_vocab=vocab), target)  # policy="argmax" by default
    batch = as_prompt_batch(ragged_prompts(), 0)
    drafter.begin(batch, HFTarget(target, output_hidden_states=True).prefill(batch))
    prop = drafter.propose(torch.tensor([5, 6, 7]), 7, Sampling(1.0), torch.Generator())
    assert prop.q is None  # one-hot: verification accepts d_k with probability p_k(d_k)
    assert drafter.last_logits.shape[-1] == 64
    assert torch.equal(prop.tokens, vocab.sort().values[drafter.last_logits[:, 1:].argmax(-1)])
    sampled = DFlashDrafter(drafter.model, target, policy="sample")
    sampled.cache = drafter.cache
    at_zero = sampled.propose(torch.tensor([5, 6, 7]), 7, Sampling(0.0), torch.Generator())
    assert at_zero.q is None and torch.equal(at_zero.tokens, prop.tokens)  # "sample" at T = 0 is the argmax


def test_bad_policy_says_which_are_allowed(target):
    with pytest.raises(ValueError, match=r"unknown drafting policy 'greedy': expected one of 'argmax', 'sample'"):
        DFlashDrafter(drafter_model(target), target, policy="greedy")


def test_load_drafter_passes_the_policy_through(target, tmp_path):
    drafter_model(target).save_pretrained(tmp_path)
    assert ms.load_drafter(tmp_path, target).policy == "argmax"
    assert ms.load_drafter(tmp_path, target, policy="sample", num_draft_tokens=3).policy == "sample"
    with pytest.raises(ValueError, match="unknown drafting policy 'best'"):
        ms.load_drafter(tmp_path, target, policy="best")
    with pytest.raises(ValueError, match="'ngram' is not a DFlash drafter"):
        ms.load_drafter("ngram", target, policy="sample")


# --- exactness of sampled drafts, statistically ------------------------------------------------------
#
# A target over V = 8 tokens, a drafter over 5 of them (a reduced draft vocabulary, block of 4, K = 3).
# N_SEQ copies of one prompt decode 3 tokens each at T = 1 with sampled drafts: the first comes from the
# prefill, the next two from verification (accepted drafts, corrections or the bonus). Exactness says the
# 3-token prefix (t0, t1, t2) has probability P(t0) P(t1 | t0) P(t2 | t0, t1), taken from the target's own
# forward over all 64 two-token continuations. Pass: p-value > ALPHA_PASS; a drafter that samples from q
# but tells the verifier q at another temperature must fail with p-value < ALPHA_BROKEN.

V_TOY, N_SEQ, DRAFT_VOCAB = 8, 4000, (1, 2, 4, 5, 7)
TOY_PROMPT = torch.tensor([2, 5, 6, 1, 4])


def toy_models():
    torch.manual_seed(0)
    cfg = Gemma4TextConfig(vocab_size=V_TOY, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           layer_types=[SLIDING, FULL], num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                           global_head_dim=32, sliding_window=16, hidden_size_per_layer_input=0,
                           vocab_size_per_layer_input=V_TOY, final_logit_softcapping=30.0, pad_token_id=0,
                           eos_token_id=None, bos_token_id=2, initializer_range=0.1)
    target = Gemma4ForCausalLM(cfg).eval()
    dcfg = DFlashConfig.for_target(cfg, [0], MASK_ID, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, block_size=4,
                                   draft_vocab_size=len(DRAFT_VOCAB), initializer_range=0.1)
    torch.manual_seed(1)
    model = DFlashDraftModel.for_target(dcfg, target)
    model.set_draft_vocab(torch.tensor(DRAFT_VOCAB))
    return target, model.eval()


@pytest.fixture(scope="module")
def toy():
    return toy_models()


class WrongTemperatureQDrafter(DFlashDrafter):
    """Samples its drafts from q at T, but tells the verifier q at T / 2 (q^2 renormalised): the classic bug of
    a drafter whose reported q is not the distribution it sampled from."""

    def propose(self, last, k, sampling, generator=None):
        prop = super().propose(last, k, sampling, generator)
        q = prop.q.square()
        return Proposal(prop.tokens, q / q.sum(-1, keepdim=True))


def prefix_p_value(target, drafter) -> float:
    out = ms.speculative_generate(target, drafter, TOY_PROMPT.expand(N_SEQ, -1), 3, temperature=1.0,
                                  generator=torch.Generator().manual_seed(0))
    assert out.lengths.tolist() == [3] * N_SEQ and 1.2 < out.stats.tau < 3.9  # drafts both accepted and rejected
    with torch.no_grad():
        pairs = torch.cartesian_prod(torch.arange(V_TOY), torch.arange(V_TOY))  # every (t0, t1)
        P = smp.sampling_probs(target(torch.cat([TOY_PROMPT.expand(len(pairs), -1), pairs], 1)).logits[:, -3:], 1.0)
    p0, p1, p2 = P[0, 0], P[:: V_TOY, 1], P[:, 2].view(V_TOY, V_TOY, V_TOY)
    expected = p0[:, None, None] * p1[:, :, None] * p2
    t = out.tokens
    observed = torch.bincount((t[:, 0] * V_TOY + t[:, 1]) * V_TOY + t[:, 2], minlength=V_TOY**3)
    return chi_square_p_value(observed, expected)


def test_sampled_drafts_keep_the_target_distribution(toy):
    target, model = toy
    assert prefix_p_value(target, DFlashDrafter(model, target, policy="sample")) > ALPHA_PASS


def test_the_same_test_rejects_a_wrong_q(toy):
    target, model = toy
    assert prefix_p_value(target, WrongTemperatureQDrafter(model, target, policy="sample")) < ALPHA_BROKEN
