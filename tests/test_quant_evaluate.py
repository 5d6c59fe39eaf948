"""The evaluation suite: token categories, metrics and recovery, reply-length drift, and the two DFlash
measurements (τ with a quantized target, τ of a W4A16 drafter) on a tiny target and drafter."""
import copy
import statistics

import pytest
import torch

from minispec import quant
from minispec.dflash.config import DFlashConfig
from minispec.dflash.model import DFlashDraftModel
from minispec.quant import evaluate as ev
from minispec.quant.modules import QuantLinear
from tiny import tiny_gemma


def test_token_categories():
    cases = {"    ": "whitespace", "\n": "whitespace", " def": "keyword", "self": "keyword", " foo_bar": "name",
             "x1": "name", " 42": "literal", "'": "literal", '"abc': "literal", "(": "punctuation",
             " ==": "punctuation", "):": "punctuation"}
    for text, cat in cases.items():
        assert ev.token_category(text) == cat, text


def test_metric_suite_and_recovery():
    cats = torch.tensor([0, 2, 3])  # token 0: name, 1: whitespace, 2: punctuation
    targets = torch.tensor([0, 1, 2, 0])
    ref = ev.Predictions(torch.tensor([0, 1, 2, 1]), torch.log(torch.tensor([0.5, 0.5, 0.5, 0.25])), targets)
    q = ev.Predictions(torch.tensor([0, 2, 2, 1]), torch.log(torch.tensor([0.5, 0.25, 0.5, 0.25])), targets)
    mr, mq = ev.metric_suite(ref, ref, cats), ev.metric_suite(q, ref, cats)
    assert mr["accuracy"] == 0.75 and mr["agreement"] == 1.0
    assert mq["accuracy"] == 0.5 and mq["agreement"] == 0.75 and mq["accuracy/whitespace"] == 0.0
    assert mr["likelihood/name"] == pytest.approx((0.5 * 0.25) ** 0.5)
    rec = ev.recovery(mq, mr)
    assert rec["accuracy"] == pytest.approx(2 / 3) and rec["accuracy/punctuation"] == 1.0
    assert "accuracy/whitespace" not in rec or rec["accuracy/whitespace"] == 0.0
    assert ev.median_recovery(mq, mr) == pytest.approx(statistics.median(rec.values()))
    with pytest.raises(ValueError, match="different tokens"):
        ev.metric_suite(q, ev.Predictions(ref.argmax, ref.logprob, targets.flip(0)), cats)


def test_length_prompts_end_before_eos_and_drift():
    eos, bos = 1, 2
    files = [torch.arange(10, 10 + n) for n in (300, 40, 250, 500)]
    stream = torch.cat([torch.cat([torch.tensor([bos]), f, torch.tensor([eos])]) for f in files])
    prompts = ev.length_prompts(stream, eos, bos, n=3, prompt_len=96)
    for p in prompts:
        assert len(p) == 96 and not ((p == eos) | (p == bos)).any()
    with pytest.raises(ValueError, match="long enough"):
        ev.length_prompts(stream, eos, bos, n=4, prompt_len=96)
    assert ev.length_drift(torch.tensor([105, 105]), torch.tensor([100, 100])) == pytest.approx(0.05)


def test_reply_lengths_stop_at_eos_or_a_stop_token():
    import minispec as ms

    model = tiny_gemma(layers=2, seed=4)
    prompts = torch.randint(4, 4096, (2, 6), generator=torch.Generator().manual_seed(0))
    tokens = ms.autoregressive_generate(model, prompts, 12).tokens
    assert ev.reply_lengths(model, prompts, 12).tolist() == [12, 12]  # a random model never says EOS
    stop = int(tokens[0, 4])
    first = [next((i + 1 for i, t in enumerate(row.tolist()) if t == stop), 12) for row in tokens]
    assert ev.reply_lengths(model, prompts, 12, stop_ids=[1, stop]).tolist() == first
    assert first[0] <= 5


@pytest.fixture(scope="module")
def target_and_drafter():
    target = tiny_gemma(layers=4, window=16, seed=0)
    with torch.no_grad():
        target.get_input_embeddings().weight.mul_(5.0)
    torch.manual_seed(1)
    cfg = DFlashConfig.for_target(target.config, [1, 2], 3, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  layer_types=["sliding_attention"], sliding_window=16, block_size=4)
    return target, DFlashDraftModel.for_target(cfg, target)


def test_quantized_drafter_and_target_tau(target_and_drafter):
    target, drafter = target_and_drafter
    prompts = [torch.randint(4, 4096, (12,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    qd = ev.quantize_drafter(drafter)
    assert isinstance(qd.fc, QuantLinear) and not isinstance(drafter.fc, QuantLinear)
    assert not any(isinstance(m, QuantLinear) for m in target.modules())
    assert qd._target is drafter._target  # the borrowed embedding and head are shared, not copied
    r = ev.tau_of_quantized_drafter(target, drafter, prompts, max_new_tokens=12)
    assert 1.0 <= r["tau_w4a16_drafter"] <= 4 and 1.0 <= r["tau_bf16_drafter"] <= 4
    qt = quant.quantize(copy.deepcopy(target), quant.AGGRESSIVE)
    r = ev.tau_with_quantized_target(target, qt, drafter, prompts, max_new_tokens=12)
    assert 1.0 <= r["tau_quantized_target"] <= 4 and r["ratio"] == pytest.approx(
        r["tau_quantized_target"] / r["tau_bf16_target"])
    assert drafter._target[0] is target.get_input_embeddings()  # re-attached to the BF16 target


def test_evaluate_models_report(target_and_drafter):
    from transformers import AutoTokenizer

    from minispec.targets.evalset import EvalSet
    from minispec.targets.load import CHECKPOINTS

    target, drafter = target_and_drafter
    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")
    g = torch.Generator().manual_seed(3)
    es = EvalSet([torch.randint(4, 4096, (20,), generator=g) for _ in range(3)],
                 torch.randint(4, 4096, (3, 8), generator=g), ["a", "b", "c"])
    q = quant.quantize(copy.deepcopy(target), quant.AGGRESSIVE)
    lp = [torch.randint(4, 4096, (10,), generator=g) for _ in range(2)]
    rep = ev.evaluate_models(target, {"q": q}, es, tok, n_prompts=3, length_prompts_=lp, max_new_tokens=6,
                             drafter=ev.dflash_drafter_for(drafter), spec_prompts=lp)
    assert rep["bf16"]["metrics"]["agreement"] == 1.0 and "tau" in rep["q"]["metrics"]
    assert rep["q"]["median_recovery"] == pytest.approx(statistics.median(rep["q"]["recovery"].values()))
    assert 0 < rep["q"]["metrics"]["agreement"] <= 1
    rows = ev.recovery_table(rep)
    assert rows[-2]["metric"] == "MEDIAN RECOVERY" and rows[-1]["metric"] == "reply length"


def test_prefix_share_counts_tokens_before_the_first_difference():
    ref = [torch.tensor([5, 6, 7, 1]), torch.tensor([8, 9])]
    assert ev.prefix_share(ref, ref) == 1.0
    assert ev.prefix_share([torch.tensor([5, 6, 4, 4, 1]), torch.tensor([3])], ref) == pytest.approx((2 / 4 + 0) / 2)
    assert ev.prefix_share([torch.tensor([5, 6]), torch.tensor([8, 9, 10])], ref) == pytest.approx((2 / 4 + 1) / 2)


def test_chat_suite_scores_bf16_as_one_and_a_quantized_model_below(target_and_drafter):
    from minispec.targets.evalset import EvalSet

    target, _ = target_and_drafter
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 4096, (n,), generator=g) for n in (7, 11, 9)]
    es = EvalSet([torch.randint(4, 4096, (20,), generator=g) for _ in range(3)],
                 torch.randint(4, 4096, (3, 8), generator=g), ["a", "b", "c"])
    q = quant.quantize(copy.deepcopy(target), quant.AGGRESSIVE)
    saved = {}
    rep = ev.chat_suite(target, {"bf16 copy": copy.deepcopy(target), "q": q}, prompts, es, 3, max_new_tokens=6,
                        on_row=lambda name, row: saved.update({name: row}))
    assert set(rep["bf16"]["metrics"]) == {"mtbench/agreement", "mtbench/exp_neg_kl", "mtbench/prefix",
                                           "eval/accuracy", "eval/likelihood", "eval/agreement"}
    assert rep["bf16"]["metrics"]["mtbench/agreement"] == 1.0 and rep["bf16"]["metrics"]["mtbench/exp_neg_kl"] == 1.0
    copy_row = rep["bf16 copy"]
    assert copy_row["median_recovery"] == pytest.approx(1.0) and copy_row["length_drift"] == 0.0
    assert all(r == pytest.approx(1.0, abs=1e-6) for r in copy_row["recovery"].values())
    assert rep["q"]["metrics"]["mtbench/exp_neg_kl"] < 1.0 and rep["q"]["median_recovery"] <= 1.0
    assert rep["q"]["reply_lengths"] == [6, 6, 6]  # a random model never says EOS: replies run to the cap
    assert set(saved) == {"bf16", "bf16 copy", "q"}
    again = ev.chat_suite(target, {"q": q}, prompts, es, 3, max_new_tokens=6,
                          done={"bf16": saved["bf16"], "q": {"cached": True}})
    assert again["q"] == {"cached": True} and again["bf16"] == saved["bf16"]  # a rerun keeps the rows scored


def test_score_row_caps_reply_length_drift_both_ways():
    bf16 = {"accuracy": 0.5, "agreement": 1.0}
    metrics = {"accuracy": 0.4, "agreement": 0.9}
    base = torch.tensor([100, 100])
    shorter = ev.score_row(metrics, bf16, torch.tensor([90, 90]), base)
    assert shorter["recovery"] == pytest.approx({"accuracy": 0.8, "agreement": 0.9})
    assert shorter["median_recovery"] == pytest.approx(0.85)
    assert shorter["length_drift"] == pytest.approx(-0.10) and not shorter["length_drift_ok"]
    longer = ev.score_row(metrics, bf16, torch.tensor([103, 105]), base)
    assert longer["length_drift"] == pytest.approx(0.04) and longer["length_drift_ok"]
    assert longer["reply_lengths"] == [103, 105]
    assert "length_drift" not in ev.score_row(metrics, bf16)
