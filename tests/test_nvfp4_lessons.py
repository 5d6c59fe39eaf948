"""The published Lightning and Super QAD figures in `minispec.lessons.nvfp4_qad`: each against the value the
write-up or paper states, the ones it derives from others against that arithmetic, and the figure drawn
from them."""
import pytest

from minispec.lessons import nvfp4_qad as lesson

L = lesson.LIGHTNING


def test_the_lightning_figures_are_the_write_ups():
    assert L["size_gb"] == {"bf16": 66, "nvfp4": 22}
    assert L["final"]["median_recovery"] == {"ptq": 99.24, "qad": 98.97}
    assert L["final"]["scores"]["Terminal-Bench v2.1"] == {"bf16": 24.44, "ptq": 22.05, "qad": 25.84}
    assert L["final"]["scores"]["SWE-Bench Multilingual"] == {"bf16": 37.13, "ptq": 37.00, "qad": 38.07}
    assert L["final"]["qad_minus_ptq"] == {"Terminal-Bench v2.1": 3.79, "SWE-Bench Multilingual": 1.07, "HLE": 0.65}
    assert L["intermediate"]["median_recovery"] == {"A": {"ptq": 96.33, "qad": 99.72},
                                                    "B": {"ptq": 95.84, "qad": 98.53}}
    assert (L["intermediate"]["bf16_gb"], L["intermediate"]["quantized_gb"], L["intermediate"]["A_qad_steps"]) == \
        (65.85, 21.19, 200)
    assert L["calibration_study"] == {"samples": 1000, "shortest": 8192, "longest": 131072, "best_four_over_six": 32768}
    launcher = L["launcher"]
    assert (launcher["global_batch"], launcher["seq_len"], launcher["train_samples"], launcher["calib_size"]) == \
        (16, 32768, 6400, 32)


def test_the_stated_leads_follow_from_the_stated_scores():
    for name, s in L["final"]["scores"].items():
        assert round(s["qad"] - s["ptq"], 2) == L["final"]["qad_minus_ptq"][name]
        assert s["qad"] > s["bf16"]  # QAD above BF16 on both benchmarks whose scores are given
    # the lesson: the median puts PTQ ahead while QAD leads on every benchmark the write-up names
    assert L["final"]["median_recovery"]["ptq"] > L["final"]["median_recovery"]["qad"]
    assert min(L["final"]["qad_minus_ptq"].values()) > 0
    tb = L["final"]["scores"]["Terminal-Bench v2.1"]
    assert round(100 * tb["ptq"] / tb["bf16"], 1) == 90.2 and round(100 * tb["qad"] / tb["bf16"], 1) == 105.7


def test_the_launcher_arithmetic():
    launcher = L["launcher"]
    assert launcher["train_samples"] // launcher["global_batch"] == launcher["iterations"] == 400
    # the project's QAD of SmolLM2: batch 2 of at most 224 tokens a step
    assert round(launcher["global_batch"] * launcher["seq_len"] / (2 * 224)) == 1170


def test_the_super_qad_figures_are_the_papers():
    assert lesson.SUPER_QAD == {"best_steps": 200, "worse_steps": 300, "gb200_gpu_hours_per_100_steps": 1024,
                                "recipes_compared": 3, "median_recovery": 99.62, "benchmarks": 36,
                                "reply_length_increase": 0.44, "length_increase_cap": 5}


def test_the_checkpoint_figure_draws_the_published_numbers():
    fig = lesson.lightning_checkpoints()
    left, right = fig.axes
    heights = sorted(round(p.get_height(), 2) for p in left.patches)
    assert heights == sorted([96.33, 99.72, 95.84, 98.53, 99.24, 98.97])
    assert [round(p.get_height(), 2) for p in right.patches] == [3.79, 1.07, 0.65]
    bf16_lead = right.collections[0].get_offsets()[:, 1].tolist()
    assert bf16_lead == pytest.approx([24.44 - 22.05, 37.13 - 37.00])
