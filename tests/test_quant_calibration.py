"""The calibration-length study (minispec.quant.calibration) on a tiny random target: the grid's shape, a
cell recomputed by hand, weights-only PTQ independent of the data, and activation amax that only grows."""
import copy

import pytest
import torch
from transformers import AutoTokenizer

from minispec import quant
from minispec.quant import calibration
from minispec.quant.modules import QuantLinear
from minispec.quant.qad import evaluate_kl
from minispec.targets import data
from minispec.targets.load import CHECKPOINTS
from tiny import tiny_gemma

GRID = {"counts": (1, 4), "lengths": (8, 32), "seeds": (0,), "eval_windows": 2, "eval_len": 16}


@pytest.fixture(scope="module")
def setup():
    model = tiny_gemma(layers=2, seed=3)
    with torch.no_grad():  # sharper logits, so that quantization error shows in the KL
        model.get_input_embeddings().weight.mul_(5.0)
    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")
    return model, tok, calibration.calibration_grid(model, tok, **GRID)


def input_amax(model):
    return torch.stack([m.input_amax for m in model.modules() if isinstance(m, QuantLinear)])


def test_grid_shape_and_one_cell_by_hand(setup):
    model, tok, result = setup
    assert set(result["recipes"]) == {"aggressive-w4a4", "all-fp8"}
    for r in result["recipes"].values():
        assert len(r["kl"]) == 2 and len(r["kl"][0]) == 2 and all(v > 0 for row in r["kl"] for v in row)
    calib = data.random_windows(data.token_stream("train", tok), 4, 32, 0, -3)[:1, :8]
    held_out = data.random_windows(data.token_stream("val", tok), 2, 16, 0, -2)
    student = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE_W4A4, lambda m: m(input_ids=calib))
    assert result["recipes"]["aggressive-w4a4"]["kl"][0][0] == pytest.approx(evaluate_kl(model, student, held_out))


def test_weights_only_needs_no_data_and_amax_only_grows(setup):
    model, tok, result = setup
    draw = data.random_windows(data.token_stream("train", tok), 4, 32, 0, -3)
    a = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE, lambda m: m(input_ids=draw[:1, :8]))
    b = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE, lambda m: m(input_ids=draw))
    x = draw[:2]
    with torch.no_grad():
        assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)  # W4A16: the data changes nothing
    assert result["weights_only"]["kl"] > 0
    small = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE_W4A4, lambda m: m(input_ids=draw[:1, :8]))
    large = quant.quantize(copy.deepcopy(model), quant.AGGRESSIVE_W4A4, lambda m: m(input_ids=draw))
    assert (input_amax(large) >= input_amax(small)).all() and (input_amax(large) > input_amax(small)).any()


def test_plot_has_a_line_per_recipe_and_length(setup):
    fig = calibration.plot_grid(setup[2])
    assert len(fig.axes[0].lines) == 2 * 2 + 1
