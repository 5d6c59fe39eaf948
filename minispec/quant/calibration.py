"""How much calibration data does PTQ need? The calibration-length study of "NVFP4 quantization and QAD of
Nemotron 3.5 Lightning", in small: `python -m minispec.quant.calibration --target bolt-mini`.

In minispec only a recipe that quantizes activations depends on calibration data: its weight calibrations
(max, MSE, four-over-six) read the weight tensor, never a batch, so an all-W4A16 recipe gives the same model
whatever it is shown. The write-up's W4A16 study does not say which quantizer the data acts through; in Model
Optimizer's Lightning recipe the FP8 Mamba inputs and the KV cache read it.
W4A4 and FP8 layers instead keep a per-tensor input amax, the running max
|x| over the calibration forward passes (`quant.quantize`'s forward_loop), which sets the activations'
global scale (NVFP4: g = amax / (6 · 448); FP8: amax / 448). Too little data underestimates amax, and the
activations that exceed it at inference saturate; more data can only raise it.

The grid: the first `n` of `max(counts)` seeded train-split windows, each cut to its first `L` tokens
(so a larger grid point sees every token of a smaller one, and amax only grows along both axes), for each
recipe; quality is the per-token KL(BF16 ‖ PTQ) on fixed held-out windows (`qad.evaluate_kl`), averaged
over `seeds` draws of the calibration windows. The W4A16 recipe is measured once, as the data-free floor.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from minispec import cli
from minispec.quant.api import AGGRESSIVE, AGGRESSIVE_W4A4, ALL_FP8, quantize
from minispec.quant.qad import evaluate_kl


def calibration_grid(model, tokenizer, recipes=(AGGRESSIVE_W4A4, ALL_FP8), counts=(1, 2, 4, 8, 16, 32),
                     lengths=(16, 64, 256), seeds=(0, 1, 2), eval_windows: int = 16, eval_len: int = 128) -> dict:
    """PTQ quality against the number and the length of calibration sequences (see the module doc).

    Returns {counts, lengths, seeds, eval {windows, len, split}, weights_only {recipe, kl},
    recipes {name: {recipe, kl [len(counts)][len(lengths)] (mean over seeds), kl_per_seed
    [seeds][counts][lengths]}}, seconds}; KL in nats per token.
    """
    from minispec.targets import data

    t0 = time.time()
    model.eval()
    train = data.token_stream("train", tokenizer)
    held_out = data.random_windows(data.token_stream("val", tokenizer), eval_windows, eval_len, 0, -2)
    out = {"counts": list(counts), "lengths": list(lengths), "seeds": list(seeds),
           "eval": {"windows": eval_windows, "len": eval_len, "split": "val"}, "recipes": {}}
    floor = quantize(copy.deepcopy(model), AGGRESSIVE)
    out["weights_only"] = {"recipe": AGGRESSIVE, "kl": evaluate_kl(model, floor, held_out)}
    draws = {seed: data.random_windows(train, max(counts), max(lengths), seed, -3) for seed in seeds}
    for recipe in recipes:
        per_seed = []
        for seed in seeds:
            grid = []
            for n in counts:
                row = []
                for length in lengths:
                    calib = draws[seed][:n, :length]
                    student = quantize(copy.deepcopy(model), recipe, lambda m, c=calib: m(input_ids=c))
                    row.append(evaluate_kl(model, student, held_out))
                grid.append(row)
            per_seed.append(grid)
        mean = [[statistics.fmean(g[i][j] for g in per_seed) for j in range(len(lengths))] for i in range(len(counts))]
        out["recipes"][recipe["name"]] = {"recipe": recipe, "kl": mean, "kl_per_seed": per_seed}
    out["seconds"] = time.time() - t0
    return out


def plot_grid(result: dict, ax=None):
    """KL(BF16 ‖ PTQ) against the number of calibration sequences, one line per (recipe, length), the
    data-free W4A16 recipe as a dashed line. Returns the figure."""
    from minispec.viz.plots import PALETTE, axes_or_new, finish_axes

    ax = axes_or_new(ax)
    styles = ["-", "--", ":", "-."]
    for r, (name, rows) in enumerate(result["recipes"].items()):
        for j, length in enumerate(result["lengths"]):
            ax.plot(result["counts"], [row[j] for row in rows["kl"]], styles[j % len(styles)], marker="o",
                    color=PALETTE[r % len(PALETTE)], label=f"{name}, {length} tokens each")
    ax.axhline(result["weights_only"]["kl"], color="grey", linestyle="--",
               label=f"{result['weights_only']['recipe']['name']} (W4A16: no data needed)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    fig = finish_axes(ax, "PTQ quality vs calibration data", "calibration sequences", "KL(BF16 ‖ PTQ), nats/token",
                      legend=False)
    ax.legend(frameon=False, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the lines
    return fig


def main(argv: list[str] | None = None) -> None:
    import minispec as ms

    p = argparse.ArgumentParser(prog="python -m minispec.quant.calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="bolt-mini")
    p.add_argument("--seeds", type=cli.positive_int, default=3, help="calibration draws averaged per grid point")
    p.add_argument("--out", type=Path, default=Path("runs/calibration.json"))
    a = p.parse_args(argv)
    model, tok = ms.load_target(a.target)
    result = calibration_grid(model, tok, seeds=tuple(range(a.seeds)))
    result.update(target=a.target, command="python -m minispec.quant.calibration " +
                  " ".join(sys.argv[1:] if argv is None else argv))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v["kl"] for k, v in result["recipes"].items()}, indent=1))
    print(f"weights only: {result['weights_only']['kl']:.5f}; wrote {a.out}")


if __name__ == "__main__":
    main()
