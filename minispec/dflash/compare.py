"""Paired DFlash training runs side by side: `python -m minispec.dflash.compare RUN [RUN ...] --out FILE.json`.

Each RUN is the folder `python -m minispec.dflash.train` saved (its training.json records the settings, the
held-out metrics and the CPU time of the whole process). The table sets each run's first and last training
loss, held-out loss, weighted accuracy and greedy τ (`mask.acceptance_length` over the held-out replies' blocks;
beside it the loop's τ walked through those replies, `mask.walk`, for runs that recorded it) beside its
CPU-hours, and (τ − 1) per CPU-hour: what a choice buys for the CPU it costs; a run evaluated while it trained
(`--eval-every`) brings its curve of held-out τ against CPU-hours, a run continued from another (`--init-from`)
its stages' CPU-hours, steps and curves added up. Runs are paired when they share the data, the seed and the
held-out rows; the table names the settings in which they differ. `--keep FILE.json` carries the rows of an
earlier table over, so that a run retrained on another machine joins the runs it was paired with.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from minispec.dflash.train import Settings
from minispec.results import machine

CHOICES = ("init_from_target", "distill", "num_layers", "block_size", "num_anchors", "lr", "mixed_precision", "steps",
           "train_shards", "tap_layers")


def run_row(folder: Path) -> dict:
    """One run's row from its training.json."""
    path = Path(folder) / "training.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: name the folder `python -m minispec.dflash.train` saved")
    record = json.loads(path.read_text())
    if record.get("val_tau_greedy_blocks") is None or record.get("cpu_seconds") is None:
        raise ValueError(f"{path} has no held-out tau or CPU time: it was trained on another data set or by an "
                         "older version; retrain it with --data sharegpt")
    stages = stages_of(record)
    tau = record["val_tau_greedy_blocks"]
    curve, hours = [], 0.0  # hours: the CPU-hours of the stages before, then of all of them
    for stage in stages:
        curve += [[round(hours + h["cpu_seconds"] / 3600, 4), round(h["val_tau"], 4)]
                  for h in stage.get("val_history", [])]
        hours += stage["cpu_seconds"] / 3600
    defaults = asdict(Settings())  # a setting added since a run was made had its default then
    return {"run": Path(folder).name, **{k: record["settings"].get(k, defaults[k]) for k in CHOICES},
            "steps": sum(stage["settings"]["steps"] for stage in stages), "stages": len(stages),
            "parameters": record["parameters"], "first_loss": round(stages[0]["loss_history_every_10"][0], 3),
            "final_train_loss": round(record["final_train_loss_avg100"], 3), "val_loss": round(record["val_loss"], 3),
            "val_accuracy": round(record["val_weighted_accuracy"], 4), "val_tau": round(tau, 3),
            "val_loop_tau": None if record.get("val_loop_tau") is None else round(record["val_loop_tau"], 3),
            "cpu_hours": round(hours, 3), "tau_gain_per_cpu_hour": round((tau - 1) / hours, 3),
            "curve": curve, "command": " && ".join(stage["command"] for stage in stages)}


def stages_of(record: dict) -> list[dict]:
    """A run continued with `--init-from` keeps the run it started from under `previous_stage`: its stages,
    first first, so that CPU time, steps and the held-out curve count from the random start."""
    stages = [record]
    while stages[0].get("previous_stage"):
        stages.insert(0, stages[0]["previous_stage"])
    return stages


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.dflash.compare", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--keep", type=Path, help="an earlier --out file: its rows stay, in their order, but for the runs "
                                             "named again (the folders of runs made on another machine need not be "
                                             "here); the runs new to it follow")
    a = p.parse_args(argv)
    fresh = {row["run"]: row for row in map(run_row, a.runs)}
    kept = json.loads(a.keep.read_text())["rows"] if a.keep is not None else []
    rows = [fresh.pop(row["run"], row) for row in kept] + list(fresh.values())
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items() if k not in ("command", "curve")))
    if a.out is not None:
        command = "python -m minispec.dflash.compare " + shlex.join(sys.argv[1:] if argv is None else argv)
        a.out.write_text(json.dumps({"command": command, "machine": machine(), "rows": rows}, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
