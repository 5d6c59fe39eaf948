"""`python -m minispec.bench dflash`: its rows, outputs identical to plain decoding at T = 0 for every method
(Hugging Face's prompt lookup included), and a cost model whose prediction comes from isolated timings,
not from the run it predicts. Short settings; no test asserts a wall-clock value beyond what a sleep
guarantees."""
import importlib.util
import json
import time

import pytest
import torch

import minispec as ms
import minispec.bench.dflash as bench
import minispec.speculative.speculative as loop
from minispec import costs
from minispec.bench import main
from minispec.bench.decoding import CycleCosts, isolated_costs
from minispec.dflash.config import DFlashConfig
from minispec.dflash.drafter import DFlashDrafter
from minispec.dflash.model import DFlashDraftModel
from minispec.drafters import NGramDrafter
from minispec.speculative.drafter import Sampling
from minispec.targets import mtbench, smollm2

ACCEPTANCE_COLUMNS = ["target", "drafter", "drafter_weights", "policy", "T", "prompts", "max_new_tokens", "tau",
                      "argmax_ceiling_tau", "draft_vocab_coverage", *[f"acc_{k}" for k in range(1, 8)]]
TIMING_COLUMNS = ["target", "method", "T", "K", "prompts", "tau", "tokens_per_s", "speedup", "speedup_vs", "C_t_ms",
                  "C_d_ms", "C_v_ms", "predicted_speedup", "cycle_ms", "overhead_ms", "identical_to_ar"]


def run_bench(tmp_path, *argv) -> list[dict]:
    """The CLI in this process (torch's thread count restored after), its rows read back from the JSON."""
    threads = torch.get_num_threads()
    try:
        main(["dflash", "--threads", "1", "--repeats", "1", "--json", str(tmp_path / "dflash.json"), *argv])
    finally:
        torch.set_num_threads(threads)
    return json.loads((tmp_path / "dflash.json").read_text())["rows"]


@pytest.fixture(scope="module")
def bolt_rows(tmp_path_factory):
    return run_bench(tmp_path_factory.mktemp("bench"), "--eval-prompts", "3", "--eval-batch", "2", "--prompts", "2",
                     "--max-new-tokens", "16", "--temperatures", "0", "1", "--timing-temperatures", "0", "1")


def test_bolt_mini_rows_have_the_columns(bolt_rows):
    acceptance = [r for r in bolt_rows if "policy" in r]
    timing = [r for r in bolt_rows if "method" in r]
    assert len(acceptance) + len(timing) == len(bolt_rows)
    assert all(list(r) == ACCEPTANCE_COLUMNS for r in acceptance)
    assert all(list(r) == TIMING_COLUMNS for r in timing)
    assert [(r["T"], r["policy"]) for r in acceptance] == [(0.0, "both"), (1.0, "argmax"), (1.0, "sample")]
    assert all(r["target"] == "bolt-mini" and r["drafter"] == "bolt-mini-dflash" and r["prompts"] == 3
               for r in acceptance)
    assert acceptance[0]["argmax_ceiling_tau"] == 8.0 and 1 <= acceptance[1]["argmax_ceiling_tau"] <= 8
    assert all(r["draft_vocab_coverage"] == 1.0 for r in acceptance)  # bolt-mini's drafter drafts every token
    assert [(r["T"], r["method"]) for r in timing] == [
        (0.0, "autoregressive"), (0.0, "ngram"), (0.0, "DFlash"), (0.0, "HF generate greedy"),
        (0.0, "HF prompt lookup"), (0.0, "HF assisted decoding"),
        (1.0, "autoregressive"), (1.0, "ngram"), (1.0, "DFlash argmax"), (1.0, "DFlash sample")]
    for r in timing:
        assert r["prompts"] == 2 and r["tau"] >= 1 and r["tokens_per_s"] > 0
        assert r["K"] == (0 if r["method"] in ("autoregressive", "HF generate greedy") else 7)
        if r["method"] != "HF assisted decoding":  # its drafting is not timed alone: no prediction
            assert r["C_t_ms"] > 0 and r["C_v_ms"] > 0 and r["C_d_ms"] >= 0
            assert r["predicted_speedup"] == pytest.approx(
                costs.speedup(r["tau"], r["C_t_ms"], r["C_d_ms"], r["C_v_ms"]), rel=0.02)


def test_either_part_can_be_skipped(tmp_path):
    """Acceptance and wall clock can run at different times: an empty list of temperatures skips that part."""
    common = ["--eval-prompts", "2", "--eval-batch", "2", "--prompts", "1", "--max-new-tokens", "8"]
    acceptance_only = run_bench(tmp_path, *common, "--temperatures", "0", "--timing-temperatures")
    assert [(r["T"], r["policy"]) for r in acceptance_only] == [(0.0, "both")]
    timing_only = run_bench(tmp_path, *common, "--temperatures", "--timing-temperatures", "0")
    assert timing_only and all("method" in r for r in timing_only)


def test_dflash_is_timed_at_each_k_asked_for(tmp_path):
    """`--draft-tokens`: one DFlash row per K, each exact at T = 0; a K twice or past the block is refused."""
    common = ["--prompts", "1", "--max-new-tokens", "8", "--temperatures", "--timing-temperatures", "0"]
    rows = run_bench(tmp_path, *common, "--draft-tokens", "2", "7")
    dflash = [(r["method"], r["K"], r["identical_to_ar"]) for r in rows if r["method"].startswith("DFlash")]
    assert dflash == [("DFlash K=2", 2, True), ("DFlash", 7, True)]
    assert {r["method"]: r["K"] for r in rows}["HF prompt lookup"] == 7  # the others keep the drafter's K
    with pytest.raises(ValueError, match="names a K twice"):
        run_bench(tmp_path, *common, "--draft-tokens", "3", "3")
    with pytest.raises(ValueError, match="drafts 1 to 7 tokens"):
        run_bench(tmp_path, *common, "--draft-tokens", "8")


PICK_COLUMNS = ["target", "drafter", "K", "tuning_prompts", "acc_k", "expected_tau", "C_t_ms", "C_d_ms", "C_v_ms",
                "predicted_speedup", "picked"]


def test_the_cost_model_picks_k_on_held_out_prompts(tmp_path, monkeypatch):
    """`--draft-tokens auto`: a row per K with the tau the held-out acceptance predicts there and the speedup
    that follows from that K's isolated costs; the largest is picked and timed, its row named so. The benchmark
    prompts are never looked at to pick."""
    seen = []
    real = bench.acceptance
    monkeypatch.setattr(bench, "acceptance", lambda target, drafter, prompts, *a, **kw: (
        seen.append([p.tolist() for p in prompts]) or real(target, drafter, prompts, *a, **kw)))
    rows = run_bench(tmp_path, "--prompts", "1", "--max-new-tokens", "8", "--temperatures", "--timing-temperatures",
                     "0", "--draft-tokens", "auto", "7", "--tuning-prompts", "2")
    picks = [r for r in rows if "picked" in r]
    assert [r["K"] for r in picks] == list(range(1, 8)) and all(list(r) == PICK_COLUMNS for r in picks)
    assert sum(r["picked"] for r in picks) == 1
    best = max(picks, key=lambda r: r["predicted_speedup"])
    assert best["picked"]
    rates = [r["acc_k"] for r in picks]
    for r in picks:
        assert r["expected_tau"] == pytest.approx(costs.expected_tau(rates[: r["K"]]), abs=0.01)
        assert r["predicted_speedup"] == pytest.approx(
            costs.speedup(r["expected_tau"], r["C_t_ms"], r["C_d_ms"], r["C_v_ms"]), rel=0.02)
    evalset = [p.tolist() for p in ms.load_evalset().prompts]
    assert len(seen) == 1 and len(seen[0]) == 2 and not any(p in evalset for p in seen[0])
    dflash = [(r["method"], r["K"]) for r in rows if r.get("method", "").startswith("DFlash")]
    k = best["K"]
    name = "DFlash (cost model's K)" if k == 7 else f"DFlash K={k} (cost model's K)"
    assert dflash == ([(name, 7)] if k == 7 else [(name, k), ("DFlash", 7)])


def test_held_out_prompts_are_first_turns_from_the_shipped_reply_set():
    from minispec.bench.decoding import tuning_prompts
    from minispec.dflash.data import DATASETS, heldout_prompts

    prompts = heldout_prompts(DATASETS / "smollm2-135m-sharegpt", 3)
    assert len(prompts) == 3 and all(p.dtype == torch.long and 0 < len(p) <= 512 for p in prompts)
    assert all(p[0] == 1 for p in prompts)  # <|im_start|>: SmolLM2's chat template opens every prompt
    assert [p.tolist() for p in tuning_prompts("smollm2-135m", None, 3)] == [p.tolist() for p in prompts]
    with pytest.raises(ValueError, match="fewer than the 100000 asked for"):
        heldout_prompts(DATASETS / "smollm2-135m-sharegpt", 100_000)


def test_every_method_is_identical_to_ar_at_t0(bolt_rows):
    """Hugging Face's prompt lookup and assisted decoding included: each output's first n tokens are plain
    decoding's n tokens."""
    at_zero = [r for r in bolt_rows if r.get("method") and r["T"] == 0]
    assert len(at_zero) == 6 and all(r["identical_to_ar"] is True for r in at_zero)
    assert all(r["identical_to_ar"] == "-" for r in bolt_rows if r.get("method") and r["T"] > 0)


def test_identical_compares_up_to_the_ar_length():
    ar = [torch.tensor([5, 6, 1])]  # plain decoding stopped at its EOS (1)
    assert bench.identical([torch.tensor([5, 6, 1, 0, 0])], ar)  # padded after it: still identical
    assert not bench.identical([torch.tensor([5, 6])], ar)  # stopped early
    assert not bench.identical([torch.tensor([5, 7, 1])], ar)


def test_methods_take_turns_and_each_keeps_its_faster_pass(monkeypatch):
    """A warm-up per method, then rounds in which every method decodes the whole set: a slow stretch of the
    machine's clock falls on every method, not on whichever was timed first."""
    calls = []

    def decoder(name):
        def decode(prompt):
            calls.append((name, int(prompt[0])))
            return bench.Decoded(prompt.clone(), len(prompt), [])
        return decode

    clock = iter([3.0, 2.0, 1.0, 4.0])  # pass 1: a 3 s, b 2 s; pass 2: a 1 s, b 4 s
    monkeypatch.setattr(bench, "timed", lambda fn, repeats, warmup: (next(clock), fn()))
    runs = bench.timed_sets({"a": decoder("a"), "b": decoder("b")}, [torch.tensor([1, 5]), torch.tensor([2])])
    warmup, one_pass = [("a", 1), ("b", 1)], [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    assert calls == warmup + one_pass + one_pass
    assert (runs["a"].seconds, runs["b"].seconds) == (1.0, 2.0)
    assert runs["a"].tokens_per_s == 3.0 and runs["a"].forwards == 3 and runs["a"].tau == 1.0


@pytest.fixture(scope="module")
def target():
    return ms.load_target("bolt-mini")[0]


def prompts(n=2):
    return ms.load_evalset().prompts[:n]


@pytest.mark.parametrize("policy", ["argmax", "sample"])
def test_costs_are_timed_without_the_speculative_loop(target, monkeypatch, policy):
    """isolated_costs never runs the loop (its verify raises here) and leaves the drafter usable."""
    def no_loop(*args, **kwargs):
        raise AssertionError("isolated_costs ran the speculative loop")

    drafters = [NGramDrafter(target.config.vocab_size, num_draft_tokens=7),
                ms.load_drafter("bolt-mini-dflash", target, policy=policy)]
    with monkeypatch.context() as m:
        m.setattr(loop, "verify", no_loop)
        parts = [isolated_costs(target, d, prompts(1)[0], Sampling(1.0), repeats=1) for d in drafters]
    for p in parts:
        assert p.c_t > 0 and p.c_d > 0 and p.c_v > 0
    out = ms.speculative_generate(target, drafters[1], prompts(1), 8)
    assert torch.equal(out.tokens, ms.autoregressive_generate(target, prompts(1), 8).tokens)


def test_prediction_does_not_move_with_the_loops_wall_time(target, monkeypatch):
    """With the isolated costs fixed, slowing the loop down (a sleep in every verification) changes the measured
    cycle and speedup, not the prediction: C_d and C_v are not derived from the run they predict."""
    fixed = CycleCosts(c_t=0.004, c_d=0.001, c_v=0.005)
    monkeypatch.setattr(bench, "isolated_costs", lambda *args, **kwargs: fixed)
    drafter = ms.load_drafter("bolt-mini-dflash", target)
    fast = bench.side_by_side(target, drafter, prompts(), 16, temperature=0.0)
    verify, pause = loop.verify, 0.05

    def slow_verify(*args, **kwargs):
        time.sleep(pause)
        return verify(*args, **kwargs)

    monkeypatch.setattr(loop, "verify", slow_verify)
    slow = bench.side_by_side(target, drafter, prompts(), 16, temperature=0.0)
    assert fast["tau"] == slow["tau"] and fast["identical_to_ar"] is slow["identical_to_ar"] is True
    assert fast["predicted_speedup"] == slow["predicted_speedup"] == round(costs.speedup(fast["tau"], 4, 1, 5), 3)
    assert (fast["C_t_ms"], fast["C_d_ms"], fast["C_v_ms"]) == (slow["C_t_ms"], slow["C_d_ms"], slow["C_v_ms"]) == (
        4.0, 1.0, 5.0)
    # Every verification slept `pause`, and every prompt verifies at least once: at least half of the target
    # forwards (a prefill per prompt, then the verifications) took `pause` or more.
    assert slow["cycle_ms"] >= 1000 * pause / 2


# --- SmolLM2-135M-Instruct on MT-Bench -----------------------------------------------------------------------

def require_smollm2() -> None:
    """Skip unless the pip packages that carry SmolLM2-135M-Instruct and MT-Bench are installed."""
    for package, install in ((smollm2.PACKAGE, smollm2.INSTALL), (mtbench.PACKAGE, mtbench.INSTALL)):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed: `{install}`")


@pytest.fixture(scope="module")
def smollm2_drafter(request, tmp_path_factory):
    """A randomly initialised DFlash drafter for SmolLM2 (its taps, mask token and a 8,192-token draft
    vocabulary), saved as a folder the bench loads with --drafter."""
    require_smollm2()
    target, _ = request.getfixturevalue("smollm2")
    torch.manual_seed(0)
    cfg = DFlashConfig.for_target(target.config, [1, 7, 14, 20, 27], 16, hidden_size=576, intermediate_size=256,
                                  num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                  block_size=8, draft_vocab_size=8192)
    model = DFlashDraftModel.for_target(cfg, target)
    model.set_draft_vocab(torch.arange(8192))
    folder = tmp_path_factory.mktemp("smollm2-dflash")
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_smollm2_on_mtbench(smollm2_drafter, tmp_path):
    rows = run_bench(tmp_path, "--target", "smollm2-135m", "--drafter", str(smollm2_drafter), "--eval-prompts", "2",
                     "--eval-batch", "2", "--prompts", "1", "--max-new-tokens", "4", "--temperatures", "0", "1",
                     "--dtype", "bfloat16")  # every method in the target's bfloat16, still exact
    acceptance = [r for r in rows if "policy" in r]
    timing = [r for r in rows if "method" in r]
    assert [(r["T"], r["policy"]) for r in acceptance] == [(0.0, "both"), (1.0, "argmax"), (1.0, "sample")]
    assert all(r["target"] == "smollm2-135m" and r["prompts"] == 2 for r in acceptance)
    # no draft LM shares SmolLM2's tokenizer: no assisted-decoding row
    assert [r["method"] for r in timing] == ["autoregressive", "ngram", "DFlash", "HF generate greedy",
                                            "HF prompt lookup"]
    assert all(r["identical_to_ar"] is True for r in timing)


def test_policy_is_a_dflash_drafters_only(target):
    assert isinstance(ms.load_drafter("bolt-mini-dflash", target, policy="sample"), DFlashDrafter)
    with pytest.raises(ValueError, match="'bolt-nano' is not a DFlash drafter"):
        ms.load_drafter("bolt-nano", target, policy="argmax")


def test_draft_vocab_coverage_counts_the_tokens_a_reduced_vocabulary_can_draft():
    from minispec.bench.dflash import draft_vocab_coverage

    class Model:
        def draft_vocab(self):
            return torch.tensor([2, 5, 9])

    class Drafter:
        model = Model()

    continuations = [torch.tensor([2, 5, 7]), torch.tensor([9, 1])]
    assert draft_vocab_coverage(Drafter(), continuations) == pytest.approx(3 / 5)
    assert draft_vocab_coverage(NGramDrafter(16), continuations) == 1.0
