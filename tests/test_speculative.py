import pytest
import torch

import minispec as ms
from minispec.drafters import DraftLMDrafter, NGramDrafter
from minispec.drafters.ngram import lookup
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.target import HFTarget
from tiny import assert_same_as_ar, tiny_gemma


@pytest.fixture(scope="module")
def target():
    return tiny_gemma(layers=6, seed=0)


def prompts_with_repeats(n_rows=3, seed=0):
    """Ragged prompts, longer than the 16-token window, that repeat themselves (so n-grams hit)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in (41, 23, 57)[:n_rows]:
        motif = torch.randint(4, 4096, (7,), generator=g)
        rows.append(torch.cat([motif.repeat(length // 7 + 1)[:length - 5], torch.randint(4, 4096, (5,), generator=g)]))
    return rows


def test_rollback_equals_a_fresh_forward(target):
    """After ragged rollbacks past the sliding window, the next logits equal a fresh prefill's."""
    prompts = prompts_with_repeats()
    g = torch.Generator().manual_seed(5)
    t = HFTarget(target)
    t.prefill(as_prompt_batch(prompts, 0))
    kept = [p.tolist() for p in prompts]
    for _ in range(6):
        block = torch.randint(4, 4096, (3, 5), generator=g)
        t.forward(block)
        keep = torch.randint(1, 6, (3,), generator=g)
        t.rollback(keep, 5)
        for b in range(3):
            kept[b] += block[b, : int(keep[b])].tolist()
    probe = torch.randint(4, 4096, (3, 1), generator=g)
    ours = t.forward(probe).logits[:, -1]
    fresh = HFTarget(target).prefill(as_prompt_batch([torch.tensor(k + [int(p)]) for k, p in zip(kept, probe)], 0))
    assert torch.allclose(ours, fresh.logits[:, -1], atol=1e-4), (ours - fresh.logits[:, -1]).abs().max()


def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2], k=3, max_n=3, min_n=1) == [3, 9, 1]
    assert lookup([5, 6, 7], k=2, max_n=3, min_n=1) == []
    assert lookup([1, 2, 1, 3, 1], k=2, max_n=2, min_n=1) == [3, 1]  # the most recent match wins


def test_greedy_ngram_equals_ar_ragged_and_past_window(target):
    prompts = prompts_with_repeats()
    assert_same_as_ar(target, NGramDrafter(4096, num_draft_tokens=4), prompts, 40)
    assert_same_as_ar(target, NGramDrafter(4096, num_draft_tokens=4), prompts[2:], 40)


def test_self_drafting_accepts_everything(target):
    """The target drafting for itself at T=0 is always right: τ = K + 1 on every full cycle."""
    prompts = prompts_with_repeats()
    spec = assert_same_as_ar(target, DraftLMDrafter(tiny_gemma(layers=6, seed=0), num_draft_tokens=3), prompts, 33)
    full = [c for c in spec.stats.cycles if len(c.emitted) == 4]
    assert full and all(c.accepted == 3 for c in spec.stats.verifications)
    assert spec.stats.per_position.tolist() == [1.0, 1.0, 1.0]


def test_greedy_draft_lm_equals_ar(target):
    spec = assert_same_as_ar(target, DraftLMDrafter(tiny_gemma(layers=2, seed=1), num_draft_tokens=4),
                             prompts_with_repeats(), 30)
    assert spec.stats.max_proposed == 4


def test_stats_and_on_cycle(target):
    seen = []
    prompts = prompts_with_repeats()
    spec = ms.speculative_generate(target, NGramDrafter(4096, num_draft_tokens=5), prompts, 25, on_cycle=seen.append)
    assert seen == spec.stats.cycles
    for b in range(3):
        # Record 0 of each sequence is the prefill's token; the rest come from verification cycles.
        mine = [c for c in seen if c.sequence == b]
        assert mine[0].proposed == 0 and mine[0].cycle == 0 and mine[0].emitted == [int(spec.tokens[b, 0])]
        emitted = [t for c in mine for t in c.emitted]
        assert emitted == spec.tokens[b, : int(spec.lengths[b])].tolist()
    verified = [c for c in seen if c.proposed > 0]
    assert spec.stats.tau == pytest.approx(sum(c.accepted + 1 for c in verified) / len(verified))
    assert int(spec.stats.histogram.sum()) == len(verified)
    for c in verified:
        statuses = [t.status for t in c.tokens]
        assert statuses == ["accepted"] * c.accepted + ["rejected"] * (c.proposed - c.accepted) + [
            "bonus" if c.accepted == c.proposed else "correction"]


def test_sampled_spec_is_seeded(target):
    def drafter():
        return DraftLMDrafter(tiny_gemma(layers=2, seed=1), num_draft_tokens=3)
    prompts = prompts_with_repeats()
    def run(seed):
        return ms.speculative_generate(target, drafter(), prompts, 20, temperature=1.0, top_k=40,
                                       generator=torch.Generator().manual_seed(seed)).tokens
    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_bad_input(target):
    with pytest.raises(ValueError, match="drafter vocab size 100 != target vocab size 4096"):
        ms.speculative_generate(target, NGramDrafter(100), [[5, 6, 7]], 4)
    with pytest.raises(ValueError, match="K must be an int >= 1"):
        ms.speculative_generate(target, NGramDrafter(4096), [[5, 6, 7]], 4, num_draft_tokens=0)
    with pytest.raises(ValueError, match="empty prompt"):
        ms.speculative_generate(target, NGramDrafter(4096), [[]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ms.speculative_generate(target, NGramDrafter(4096), [[5]], 0)


@pytest.fixture(scope="module")
def bolt64():
    """bolt-mini in float64: argmax ties between a one-token and a block forward cannot flip there."""
    return ms.load_target("bolt-mini", dtype=torch.float64)[0]


@pytest.mark.parametrize("drafter_name", ["ngram", "bolt-nano", "bolt-mini-dflash"])
def test_greedy_equals_ar_on_eval_prompts(bolt64, drafter_name):
    prompts = ms.load_evalset().prompts
    taus = []
    for batch in ([prompts[0]], [prompts[1]], prompts[2:5]):
        spec = assert_same_as_ar(bolt64, ms.load_drafter(drafter_name, bolt64), batch, 32)
        taus.append(spec.stats.tau)
    assert min(taus) > 1.0  # both drafters get drafts accepted on real code
