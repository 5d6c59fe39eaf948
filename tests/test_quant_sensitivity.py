"""AutoQuant gradient scores against a brute-force computation, monotonicity, and the budgeted recipe."""
import copy

import pytest
import torch
from torch import nn

from minispec import quant
from minispec.quant import sensitivity as sens
from minispec.quant.modules import QuantLinear
from tiny import tiny_gemma


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 16, bias=False)
        with torch.no_grad():
            self.b.weight.mul_(8)  # b's output scale, hence its score, is much larger

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def toy_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def test_score_equals_brute_force():
    toy = Toy()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 32, generator=g), torch.randn(4, 16, generator=g)) for _ in range(3)]
    scores = sens.sensitivity(toy, batches, formats=("w4a16", "fp8"), loss_fn=toy_loss)
    for name in ("a", "b"):
        for fmt in ("w4a16", "fp8"):
            want = 0.0
            for x, y in batches:
                lin = getattr(toy, name)
                probe = QuantLinear(copy.deepcopy(lin), fmt)
                probe.calibrate_weight("max")
                if fmt == "fp8":
                    inp = x if name == "a" else torch.tanh(toy.a(x)).detach()
                    probe.input_amax = inp.abs().amax()
                h = x if name == "a" else torch.tanh(toy.a(x)).detach()
                out = lin(h).detach().requires_grad_(True)
                rest = torch.tanh(out) if name == "a" else out
                loss = ((toy.b(rest) if name == "a" else rest) - y).pow(2).mean()
                (grad,) = torch.autograd.grad(loss, out)
                want += ((grad * (probe(h) - out)) ** 2).sum().item()
            assert scores[name][fmt] == pytest.approx(want, rel=1e-4), (name, fmt)
    assert scores["b"]["w4a16"] > scores["b"]["fp8"] > 0
    assert all(p.grad is None for p in toy.parameters())


def test_monotone_and_budgeted_search():
    scores = {"big": {"w4a16": 10.0, "fp8": 12.0}, "small": {"w4a16": 1.0, "fp8": 0.1}}
    mono = sens.monotone(scores)
    assert mono["big"] == {"w4a16": 10.0, "fp8": 10.0, "bf16": 0.0}
    sizes = {"big": 100, "small": 100}
    assert sens.search_formats(scores, sizes, 4.5) == {"big": "w4a16", "small": "w4a16"}
    # 4.5 -> 16 for "big" costs 1150 bits and removes 10: the best trade once it fits
    assert sens.search_formats(scores, sizes, 10.25) == {"big": "bf16", "small": "w4a16"}
    assert sens.search_formats(scores, sizes, 16) == {"big": "bf16", "small": "bf16"}
    chosen = sens.search_formats(scores, sizes, 6.25)
    assert chosen == {"big": "w4a16", "small": "fp8"} and sens.effective_bits(chosen, sizes) == 6.25
    with pytest.raises(ValueError, match="below the narrowest"):
        sens.search_formats(scores, sizes, 4.0)


def test_conservative_recipe_quantizes_a_model():
    model = tiny_gemma(layers=2, seed=0)
    batches = [torch.randint(4, 4096, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    scores = sens.sensitivity(model, batches, formats=("w4a16", "fp8"))
    assert set(scores) == set(quant.assign_formats(model, quant.AGGRESSIVE))
    assert all(s["w4a16"] > 0 for s in scores.values())
    recipe = sens.conservative_recipe(model, scores, bits_budget=6.0)
    q = quant.quantize(copy.deepcopy(model), recipe, lambda m: m(input_ids=batches[0]))
    sizes = {n: m.weight.numel() for n, m in sens.linear_layers(model).items()}
    assert 5.5 < sens.effective_bits(quant.formats_of(q), sizes) <= 6.0  # the budget is used, not exceeded
    assert set(quant.formats_of(q).values()) > {"w4a16"}


def test_recipe_from_formats_takes_the_scales_of_its_algorithm():
    for algorithm in quant.ALGORITHMS:
        recipe = sens.recipe_from_formats({"lm_head": "fp8"}, "t", algorithm)
        assert quant.check_recipe(recipe)["scales"] == quant.SCALES_OF[algorithm]
