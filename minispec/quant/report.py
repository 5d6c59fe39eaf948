"""The NVFP4 study of bolt-mini in one command: `python -m minispec.quant.report`.

Sensitivity ranking, the aggressive and the conservative recipe, their storage, PTQ vs QAD recovery on the
eval set, reply-length drift, and (when the DFlash drafter is shipped) τ with the quantized target and
with the W4A16 drafter. The QAD students are read from where `python -m minispec.quant.qad` saves them
(`qad.result_folder`; skipped when absent). Writes every number to a JSON file (docs/nvfp4.md quotes one).

`--scorecard` scores a chat target instead (SmolLM2-135M-Instruct): BF16, PTQ and QAD with one recipe on
MT-Bench's first turns and the eval set (`evaluate.chat_suite`), resumable from `--work-dir`, into a
scorecard JSON. Its "bf16-arith" row is the BF16 checkpoint run in BF16 arithmetic instead of the teacher's
FP32: what the suite reads for a model that changed nothing but rounding, its noise floor. The scorecards
that ship in minispec/results are read back by `load_result`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from minispec import cli, training
from minispec.quant import evaluate as ev
from minispec.quant import sensitivity as sens
from minispec.quant.api import AGGRESSIVE, AGGRESSIVE_W4A4, storage_report
from minispec.quant.qad import RECIPES, make_student, recipe_from_cli, result_folder
from minispec.results import machine


def sensitivity_batches(tokenizer, n: int = 4, batch: int = 2, seq_len: int = 128, seed: int = 0):
    from minispec.targets import data

    stream = data.token_stream("val", tokenizer)
    return [data.random_windows(stream, batch, seq_len, seed, 100 + i) for i in range(n)]


def scorecard(a) -> dict:
    """`--scorecard`: BF16, its BF16-arithmetic floor, PTQ and QAD of `a.target` with `a.recipe` on the chat
    suite, resumable from a.work_dir."""
    import minispec as ms
    from minispec.files import cache_dir
    from minispec.targets import data
    from minispec.targets.evalset import build

    t0 = time.time()
    recipe = recipe_from_cli(a.recipe)
    teacher, tok = ms.load_target(a.target)
    if tok.chat_template is None:
        raise ValueError(f"--scorecard scores a chat target; {a.target!r} has no chat template")
    calib = data.random_windows(data.token_stream("train", tok), 8, 64, 0, -1)  # as minispec.quant.qad calibrates
    folder = a.qad_dir or result_folder(a.target, recipe["name"])
    # The same BF16 weights in BF16 arithmetic (the teacher computes in FP32): the suite's noise floor.
    models = {"bf16-arith": ms.load_target(a.target, dtype=torch.bfloat16)[0].eval(),
              "ptq": make_student(teacher, recipe, lambda m: m(input_ids=calib)).eval()}
    if (folder / "student.pt").exists():
        models["qad"] = make_student(teacher, recipe, lambda m: m(input_ids=calib))
        models["qad"].load_state_dict(torch.load(folder / "student.pt"))
        models["qad"].eval()
    else:
        print(f"no QAD student in {folder} yet (`python -m minispec.quant.qad --target {a.target} --recipe "
              f"{a.recipe} --data replies` makes it): scoring BF16 and PTQ only")
    mtbench = ms.load_mtbench(tok)
    if a.mtbench > len(mtbench):
        raise ValueError(f"--mtbench {a.mtbench}: MT-Bench has {len(mtbench)} first turns")
    picked = [i * len(mtbench) // a.mtbench for i in range(a.mtbench)]  # evenly spaced: every category
    prompts = [mtbench.prompts[i] for i in picked]
    evalset = build(tok, n_max=a.prompts)[0]
    work = a.work_dir or cache_dir() / "train" / f"{Path(a.target).name}-scorecard-{recipe['name']}"
    work.mkdir(parents=True, exist_ok=True)
    key = f"{len(prompts)}-{a.max_new_tokens}-{a.prompts}"
    replies_path = work / f"bf16-replies-{len(prompts)}-{a.max_new_tokens}.pt"
    if replies_path.exists():
        replies = torch.load(replies_path)
    else:
        replies = ev.greedy_replies(teacher, prompts, a.max_new_tokens)
        torch.save(replies, replies_path)
    # One file per row, so that two runs (PTQ, and QAD once its student exists) can score side by side.
    digest = training.weights_digest(models["qad"]) if "qad" in models else None

    def read_rows() -> dict:
        rows = {}
        for name in ("bf16", "bf16-arith", "ptq", "qad"):
            path = work / f"row-{name}-{key}.json"
            if path.exists():
                row = json.loads(path.read_text())
                if name != "qad" or row.pop("student") == digest:  # a QAD row is for one student only
                    rows[name] = row
        return rows

    def save_row(name, row):
        (work / f"row-{name}-{key}.json").write_text(json.dumps(dict(row, student=digest) if name == "qad" else row))

    scored = {name: m for name, m in models.items() if name in a.models}
    ev.chat_suite(teacher, scored, prompts, evalset, a.prompts, a.max_new_tokens, replies, read_rows(), save_row)
    report = read_rows()  # with the rows another run scored meanwhile
    summary = folder / "summary.json"
    qad_summary = json.loads(summary.read_text()) if summary.exists() else {}
    return {"target": a.target, "recipe": recipe, "machine": machine(),
            "commands": [qad_summary.get("command"), "python -m minispec.quant.report " + " ".join(a.argv)],
            "suite": {"mtbench_prompts": len(prompts),
                      "mtbench_question_ids": [mtbench.question_ids[i] for i in picked],
                      "max_new_tokens": a.max_new_tokens,
                      "eval_prompts": a.prompts, "metrics": list(report["bf16"]["metrics"])},
            "qad": qad_summary, "seconds": {"scoring": time.time() - t0},
            "evaluation": report, "table": ev.recovery_table(report),
            "median_recovery": {n: report[n]["median_recovery"] for n in report if n != "bf16"},
            "length_drift": {n: report[n]["length_drift"] for n in report if n != "bf16"}}


def main(argv: list[str] | None = None) -> None:
    import minispec as ms
    from minispec.targets import data

    p = argparse.ArgumentParser(prog="python -m minispec.quant.report")
    p.add_argument("--target", default="bolt-mini")
    p.add_argument("--qad-dir", type=Path, help="where `minispec.quant.qad --recipe aggressive` saved student.pt "
                                                "(default: its default --out)")
    p.add_argument("--qad-w4a4-dir", type=Path, help="where `minispec.quant.qad --recipe aggressive-w4a4` saved "
                                                     "student.pt (default: its default --out)")
    p.add_argument("--bits", type=cli.positive_float, default=6.0, help="conservative recipe: effective-bits budget")
    p.add_argument("--prompts", type=cli.positive_int, default=48, help="eval prompts for the teacher-forced metrics")
    p.add_argument("--length-prompts", type=cli.positive_int, default=16)
    p.add_argument("--drafter", default="bolt-mini-dflash")
    p.add_argument("--out", type=Path, default=Path("runs/nvfp4_report.json"))
    p.add_argument("--scorecard", action="store_true",
                   help="score a chat target (BF16, PTQ, QAD of --recipe) on MT-Bench first turns and the eval set")
    p.add_argument("--recipe", default="aggressive", help=f"--scorecard: the recipe, {sorted(RECIPES)} or a recipe "
                                                          ".json file (as `minispec.quant.qad --recipe` takes it)")
    p.add_argument("--mtbench", type=cli.positive_int, default=80,
                   help="--scorecard: MT-Bench first turns used, evenly spaced over the 80 (so over every category)")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=256, help="--scorecard: reply cap")
    p.add_argument("--models", nargs="+", choices=["bf16-arith", "ptq", "qad"], default=["bf16-arith", "ptq", "qad"],
                   help="--scorecard: the rows this run scores (others are read from --work-dir where scored)")
    p.add_argument("--work-dir", type=Path, help="--scorecard: where finished parts are kept for a rerun (default: "
                                                 "~/.cache/minispec/train/<target>-scorecard-<recipe>)")
    a = p.parse_args(argv)
    if a.scorecard:
        a.argv = sys.argv[1:] if argv is None else argv
        out = scorecard(a)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(out, indent=1))
        for row in out["table"]:
            print(row)
        print(f"wrote {a.out}")
        return
    t0 = time.time()
    teacher, tok = ms.load_target(a.target)
    scores = sens.sensitivity(teacher, sensitivity_batches(tok))
    ranked = sens.ranking(scores)
    total = sum(s for _, s in ranked)
    conservative = sens.conservative_recipe(teacher, scores, a.bits)
    calib = data.random_windows(data.token_stream("train", tok), 8, 64, 0, -1)  # as minispec.quant.qad calibrates
    def loop(m):
        return m(input_ids=calib)
    models = {}
    runs = (("aggressive", AGGRESSIVE, a.qad_dir), ("aggressive-w4a4", AGGRESSIVE_W4A4, a.qad_w4a4_dir))
    for name, recipe, folder in runs:
        folder = folder or result_folder(a.target, recipe["name"])
        models[f"ptq-{name}"] = make_student(teacher, recipe, loop).eval()
        if (folder / "student.pt").exists():
            student = make_student(teacher, recipe, loop)
            student.load_state_dict(torch.load(folder / "student.pt"))
            models[f"qad-{name}"] = student.eval()
    models["ptq-conservative"] = make_student(teacher, conservative, loop).eval()
    stream = data.token_stream("test", tok)
    lp = ev.length_prompts(stream, tok.eos_token_id, tok.bos_token_id, a.length_prompts)
    drafter_model = None
    try:
        drafter_model = ms.load_drafter(a.drafter, teacher).model
    except (FileNotFoundError, ValueError) as e:
        print(f"no DFlash drafter: {e}")
    make = ev.dflash_drafter_for(drafter_model) if drafter_model is not None else None
    spec_prompts = [p[-64:] for p in ms.load_evalset().prompts[:8]]
    report = ev.evaluate_models(teacher, models, ms.load_evalset(), tok, a.prompts, lp, max_new_tokens=128,
                                drafter=make, spec_prompts=spec_prompts, stop_ids=ev.reply_stop_ids(tok))
    out = {"command": "python -m minispec.quant.report " + " ".join(sys.argv[1:] if argv is None else argv),
           "sensitivity_top10": ranked[:10], "head_share_of_w4a16_score": scores["lm_head"]["w4a16"] / total,
           "conservative_recipe": conservative,
           "storage": {n: storage_report(m) for n, m in models.items() if n.startswith("ptq")},
           "evaluation": report, "table": ev.recovery_table(report)}
    if drafter_model is not None:
        out["tau_quantized_target"] = ev.tau_with_quantized_target(teacher, models["ptq-aggressive"], drafter_model,
                                                                   spec_prompts)
        out["tau_w4a16_drafter"] = ev.tau_of_quantized_drafter(teacher, drafter_model, spec_prompts)
    out["seconds"] = time.time() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=float))
    for row in out["table"]:
        print(row)
    print({k: v for k, v in out.items() if k.startswith("tau") or k.startswith("head")})
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
