"""Measured results the notebooks show without re-running them: small JSON files beside this module, each
written by the command recorded inside it. `load_result(name)` reads one; `machine()` is the description of
the machine that every measurement (here and in `python -m minispec.bench`'s JSON) carries.
"""
from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent


def load_result(name: str) -> dict:
    """A shipped result by its file name without `.json`.

    `smollm2-135m-nvfp4-scorecard`, `smollm2-135m-nvfp4-head-bf16-scorecard` (written by `--scorecard`; recipes
    aggressive and aggressive-head-bf16):
        target, recipe (the recipe dict), machine (`machine()`'s dict),
        commands (the QAD command, then the scoring command(s)),
        suite {mtbench_prompts, max_new_tokens, eval_prompts, metrics: [metric names]},
        qad (the QAD run's summary.json: steps and settings, trained / total parameters, held-out KL before and
            after, seconds), seconds {scoring},
        evaluation {"bf16" | "ptq" | "qad": {metrics {name: value}, recovery {name: model / BF16} (not BF16),
            median_recovery (not BF16), mean_reply_length, reply_lengths, length_drift, length_drift_ok}},
        table (`evaluate.recovery_table` rows), median_recovery {"ptq", "qad"}, length_drift {"ptq", "qad"}.
    `bolt-mini-calibration` (`python -m minispec.quant.calibration`): `calibration.calibration_grid`'s dict,
        with target and command.
    `mtp-hsm-study`, `mtp-transfer` (`python -m minispec.mtp.stages hsm | transfer`): see `minispec.mtp.stages`.
    """
    path = RESULTS / f"{name}.json"
    if not path.exists():
        shipped = sorted(p.stem for p in RESULTS.glob("*.json"))
        raise FileNotFoundError(f"no result {name!r} in {RESULTS}; shipped: {shipped}")
    return json.loads(path.read_text())


def machine() -> dict:
    """What the numbers were measured on: CPU model, torch threads, versions, the GPU if any."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
