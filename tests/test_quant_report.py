"""minispec.results and minispec.quant.report: the shipped scorecards load and are consistent with themselves,
an unknown name is refused with the list of shipped ones, and `--scorecard` refuses a target that is not a chat
model."""
import json
import statistics

import pytest

from minispec import results
from minispec.quant import report
from minispec.quant.qad import RECIPES, recipe_from_cli


def test_unknown_result_names_the_shipped_ones(tmp_path, monkeypatch):
    (tmp_path / "a-result.json").write_text(json.dumps({"x": 1}))
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert results.load_result("a-result") == {"x": 1}
    with pytest.raises(FileNotFoundError, match=r"shipped: \['a-result'\]"):
        results.load_result("nope")


@pytest.mark.parametrize("name, recipe", [("smollm2-135m-nvfp4-scorecard", "aggressive"),
                                          ("smollm2-135m-nvfp4-head-bf16-scorecard", "aggressive-head-bf16"),
                                          ("smollm2-135m-nvfp4-head-bf16-4o6-scorecard", "aggressive-head-bf16-4o6"),
                                          ("smollm2-135m-nvfp4-head-bf16-4o6-mtbench80-scorecard",
                                           "aggressive-head-bf16-4o6")])
def test_smollm2_scorecard_is_consistent(name, recipe):
    card = results.load_result(name)
    ev = card["evaluation"]
    assert card["recipe"] == RECIPES[recipe] and card["machine"] and len(card["commands"]) >= 2
    assert all(f"--recipe {recipe} " in c for c in card["commands"])
    assert card["commands"][0].startswith("python -m minispec.quant.qad ")
    assert all(c.startswith("python -m minispec.quant.report ") for c in card["commands"][1:])
    assert set(ev["bf16"]["metrics"]) == set(card["suite"]["metrics"])
    assert all(v == 1.0 for k, v in ev["bf16"]["metrics"].items() if k.startswith("mtbench/") or k == "eval/agreement")
    for name in ("bf16-arith", "ptq", "qad"):
        row = ev[name]
        assert row["median_recovery"] == pytest.approx(statistics.median(row["recovery"].values()))
        assert card["median_recovery"][name] == row["median_recovery"]
        assert row["length_drift"] == pytest.approx(row["mean_reply_length"] / ev["bf16"]["mean_reply_length"] - 1)
        assert len(row["reply_lengths"]) == card["suite"]["mtbench_prompts"]
    # Rounding alone (BF16 arithmetic) costs the suite less than QAD has left, and QAD recovers some of PTQ's loss.
    assert card["median_recovery"]["bf16-arith"] > card["median_recovery"]["qad"] > card["median_recovery"]["ptq"]
    assert card["qad"]["train"] == "quantized" and card["qad"]["settings"]["steps"] >= 1


def test_calibration_grid_is_shipped():
    grid = results.load_result("bolt-mini-calibration")
    for r in grid["recipes"].values():
        assert len(r["kl"]) == len(grid["counts"]) and all(len(row) == len(grid["lengths"]) for row in r["kl"])
    assert grid["weights_only"]["kl"] > 0


def test_scorecard_refuses_a_model_without_chat_template():
    with pytest.raises(ValueError, match="chat target"):
        report.main(["--target", "bolt-mini", "--scorecard"])


def test_scorecard_recipe_is_a_name_or_a_checked_json_file(tmp_path):
    with pytest.raises(ValueError, match=r"neither a named recipe \['aggressive'"):
        report.main(["--scorecard", "--recipe", "agressive"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x", "rules": [["*", "w4a16"]], "scale": "dynamic"}))
    with pytest.raises(ValueError, match="scale"):
        report.main(["--scorecard", "--recipe", str(bad)])


def test_every_named_recipe_answers_to_its_own_name():
    assert {"aggressive", "aggressive-head-bf16", "all-fp8"} <= set(RECIPES)
    for name, recipe in RECIPES.items():
        assert recipe_from_cli(name) is recipe and recipe["name"] == name
