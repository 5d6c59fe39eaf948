"""Train a shipped target model on CPU: `python -m minispec.targets.train bolt-mini`.

The data are seeded random windows of the corpus' train split, the loss the next-token cross-entropy;
the loop is `minispec.training.train_loop` (seeded, resumable from `train_state.pt` in the work dir
every `--ckpt-every` steps, tqdm). The finished model is saved with `save_pretrained`
in bfloat16 (to keep the package small) beside the tokenizer, with `training.json` recording the
command, the data hash and the final validation loss of the saved (rounded) weights, all in one
`training.save_atomically` step: into `--out`, by default the user cache (~/.cache/minispec/models/<model>);
the shipped checkpoint is rebuilt with `--out minispec/checkpoints/<model>`.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from minispec import training
from minispec.files import cache_dir
from minispec.targets import corpus, data
from minispec.targets.configs import CONFIGS
from minispec.targets.tokenizer import load_shipped_tokenizer

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


@dataclass
class Settings(training.Settings):
    steps: int = 1100
    warmup: int = 100
    weight_decay: float = 0.1
    seq_len: int = 512
    eval_windows: int = 64

    BOOKKEEPING = training.Settings.BOOKKEEPING | {"eval_windows"}

    def __post_init__(self):
        super().__post_init__()
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (a window predicts its tokens 2..L), got {self.seq_len}")


# Per-model defaults; any field can be overridden on the command line.
# lightning-mini is sized for ~25 minutes on one core (about 4 s per step).
SETTINGS = {"bolt-mini": Settings(), "bolt-nano": Settings(steps=500, lr=3e-3),
            "lightning-mini": Settings(steps=360, lr=3e-3, warmup=30, ckpt_every=20)}


def next_token_loss(model, stream: torch.Tensor, s: Settings):
    """batch_loss(step): the next-token cross-entropy of `s.batch` seeded windows of `stream` (1-D token ids)."""
    def batch_loss(step: int):
        x = data.random_windows(stream, s.batch, s.seq_len, s.seed, step)
        loss = model(input_ids=x, labels=x).loss
        return loss, loss.item()

    return batch_loss


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int = 8) -> dict[str, float]:
    """Mean next-token loss (nats) and argmax accuracy over `[n, L]` windows."""
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        target = x[:, 1:]
        total_loss += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
        ).item()
        correct += (logits.argmax(-1) == target).sum().item()
        count += target.numel()
    model.train()
    return {"loss": total_loss / count, "accuracy": correct / count}


def train(name: str, out: Path, work_dir: Path, s: Settings, command: str | None = None) -> dict:
    """Train model `name` from scratch (resuming from `work_dir`), then save it into `out`; returns its record."""
    torch.manual_seed(s.seed)
    tok = load_shipped_tokenizer()
    train_ids = data.token_stream("train", tok)
    val_windows = data.sequential_windows(data.token_stream("val", tok), s.seq_len, s.eval_windows)

    model = AutoModelForCausalLM.from_config(CONFIGS[name]())
    history = training.train_loop({"model": model}, training.adamw(model.parameters(), s), s,
                                  next_token_loss(model, train_ids, s), work_dir / "train_state.pt",
                                  desc=f"train {name}", must_match={"model": name})

    # Ship what the package loads: bf16 weights. Measure the loss of exactly those weights.
    model = model.to(torch.bfloat16).to(torch.float32)
    metrics = evaluate(model, val_windows)
    record = {
        "command": command or "python -m minispec.targets.train " + shlex.join(sys.argv[1:]),
        "model": name,
        "settings": asdict(s),
        "train_data_sha256": corpus.data_hash(corpus.iter_files("train")),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "tokens_seen": s.steps * s.batch * s.seq_len,
        "parameters": sum(p.numel() for p in model.parameters()),
        "final_train_loss_avg100": sum(history[-100:]) / len(history[-100:]),
        "val_loss": metrics["loss"],
        "val_accuracy": metrics["accuracy"],
        "val_windows": f"{len(val_windows)} x {s.seq_len} tokens from the val split",
        "loss_history_every_10": history[::10],
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }

    def write(folder: Path) -> None:
        model.to(torch.bfloat16).save_pretrained(folder)
        tok.save_pretrained(folder)
        (folder / "training.json").write_text(json.dumps(record, indent=1))

    training.save_atomically(out, write)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.targets.train", description=__doc__.splitlines()[0])
    p.add_argument("model", choices=sorted(CONFIGS))
    p.add_argument("--out", type=Path, help="output folder (default: ~/.cache/minispec/models/<model>; the shipped "
                                            "one is rebuilt with --out minispec/checkpoints/<model>)")
    p.add_argument("--work-dir", type=Path, help="where resumable train state lives")
    training.add_settings_arguments(p, Settings, help="default: per model ({} for bolt-mini)")
    a = p.parse_args(argv)
    settings = training.settings_from_args(p, a, SETTINGS[a.model])
    out = a.out or training.default_out(a.model)
    work_dir = a.work_dir or cache_dir() / "train" / a.model
    command = "python -m minispec.targets.train " + shlex.join(sys.argv[1:] if argv is None else argv)
    record = train(a.model, out, work_dir, settings, command)
    print(f"val loss {record['val_loss']:.4f}  accuracy {record['val_accuracy']:.4f}")
    print(f"saved {out}; load it with ms.load_target({str(out)!r})")


if __name__ == "__main__":
    main()
