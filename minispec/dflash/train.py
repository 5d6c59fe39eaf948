"""Train a DFlash drafter for a shipped target on CPU: `python -m minispec.dflash.train --target bolt-mini`.

One step (the recipe of SpecForge's `train_dflash.py` and Model Optimizer's DFlash trainer; z-lab has
not published its own):

    x        = a seeded batch of training windows                      (same batch for the same (seed, step))
    F, p_t   = ONE frozen target forward: tap features (and its logits for distillation)
    anchors  = re-sampled every step from a generator seeded by (seed, step)
    logits   = ONE drafter forward over all blocks, with the training mask (`DFlashDraftModel.forward`)
    loss     = (1 - distill) * weighted CE(x[a + k]) + distill * weighted soft CE against the target's
               distribution for token a + k (read at position a + k - 1); the anchor has no loss

Two choices that buy CPU time on a real target (SmolLM2-135M), each measured in docs/benchmarks.md:

* `cache_features`: the target is frozen and its replies are fixed, so its tapped hidden states are the
  same every epoch. Run it ONCE over the replies and keep F (bf16, on disk in the user cache); a step
  then costs only the drafter. Distillation needs the target's logits, which are too big to keep
  (49 k floats per token), so a cached run trains on hard labels (the replies are the target's own).
* `draft_vocab`: draft over the most frequent target tokens of the replies only (EAGLE-3 maps its head
  to the 32 k most frequent of 128 k target tokens). The borrowed head is the drafter's largest matmul
  (49,152 x 576 on SmolLM2); a label outside the draft vocabulary carries no loss, and such a token is
  never drafted.

Only the drafter's own weights train: the target (whose embedding, and head unless the drafter has its
own, the drafter borrows) is frozen and never handed to the optimizer. The loop is
`minispec.training.train_loop`: seeded, resumable from `train_state.pt` in the work dir, which a run
continues only with the same settings, the same target weights and the same `--init-from` weights. The
drafter is saved with `training.save_atomically` into `--out`, by default the user cache
(~/.cache/minispec/models/<target>-dflash); the shipped one is rebuilt with `--out minispec/checkpoints/...`.

On several processes: `torchrun --nproc_per_node=N -m minispec.dflash.train ...` (`minispec.distributed`):
each process trains on its shard of every batch (`--batch` is the global batch, a multiple of N) on its own
GPU when there are GPUs, and a run resumes under another N.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from tqdm import tqdm

from minispec import distributed, training
from minispec.dflash import mask as dmask
from minispec.dflash.config import bolt_mini_dflash_config, is_dflash_folder, smollm2_dflash_config
from minispec.dflash.data import DATASETS, shard_slice
from minispec.dflash.model import DFlashDraftModel, num_parameters
from minispec.dflash.taps import TapSet, taps_dir
from minispec.files import cache_dir
from minispec.speculative.autoregressive import special_ids
from minispec.targets import corpus, data
from minispec.targets.load import load_target
from minispec.targets.replies import Replies, batch_rows, concatenate, generate_replies, instruction_replies
from minispec.training import weights_digest


@dataclass
class Settings(training.Settings):
    steps: int = 600
    warmup: int = 20
    weight_decay: float = 0.01
    seq_len: int = 512  # window length when training on a token stream instead of replies
    # Training data: the target's own replies to train-split prompts (SpecForge and Model Optimizer
    # regenerate the responses with the target), greedy ones for T = 0 and sampled ones for T > 0.
    greedy_replies: int = 1024
    sampled_replies: int = 512
    prompt_len: int = 64
    reply_len: int = 256
    num_anchors: int = 64  # blocks per sequence per step
    gamma: float = 4.0  # loss decay exp(-(k-1)/gamma); 4 for B = 8
    distill: float = 0.5  # weight of the soft-label loss against the target (0: hard labels only)
    eval_replies: int = 32  # greedy replies to val-split prompts
    eval_every: int = 0  # also evaluate every this many steps (the training story's curve); 0: at the end only
    cache_features: bool = False  # run the target once over the replies and train from its stored taps
    draft_vocab: int = 0  # draft over this many most frequent reply tokens; 0: the target's whole vocabulary
    # "replies": the target's replies to this project's instruction prompts, generated and cached here;
    # "sharegpt": the committed replies to ShareGPT's prompts (`minispec.dflash.data`) with the taps and
    # final hidden states `python -m minispec.dflash.taps` stored (distillation then needs no target forward)
    data: str = "replies"
    train_shards: str = ""  # "sharegpt": train on these train shards only, "N" (the first N) or "A:B"; empty: all
    init_from_target: bool = False  # the target's last layer and final norm, fc scaled per tap feature
    num_layers: int = 0  # drafter layers; 0: the target's drafter config's
    # The drafter's forward and backward in bfloat16 (torch.autocast), its weights and optimizer state in float32:
    # 1.7x the step speed on a CPU with AVX-512 BF16 (SmolLM2's drafter, one thread).
    mixed_precision: bool = False
    block_size: int = 0  # B; 0: the target's drafter config's
    tap_layers: str = ""  # the target layers tapped, comma-separated (e.g. "1,14,27"); empty: the drafter config's

    BOOKKEEPING = training.Settings.BOOKKEEPING | {"eval_replies", "eval_every"}
    ZERO_ALLOWED = training.Settings.ZERO_ALLOWED | {"greedy_replies", "sampled_replies", "distill", "draft_vocab",
                                                     "num_layers", "block_size", "eval_every"}
    DATA = ("replies", "sharegpt")

    def __post_init__(self):
        super().__post_init__()
        if self.greedy_replies == self.sampled_replies == 0:
            raise ValueError("greedy_replies and sampled_replies are both 0: at least one training reply is needed")
        if self.distill > 1:
            raise ValueError(f"distill is the weight of the soft-label loss, in [0, 1]; got {self.distill}")
        if self.data not in self.DATA:
            raise ValueError(f"data must be one of {self.DATA}, got {self.data!r}")
        if self.train_shards:
            shard_slice(self.train_shards)
        if self.tap_layers and not all(part.strip().isdigit() for part in self.tap_layers.split(",")):
            raise ValueError(f"tap_layers is a comma-separated list of layer numbers such as '1,14,27', "
                             f"got {self.tap_layers!r}")

    @property
    def tap_layer_ids(self) -> list[int]:
        return [int(part) for part in self.tap_layers.split(",")] if self.tap_layers else []


# Per-target defaults; any field can be overridden on the command line.
SETTINGS = {
    "bolt-mini": Settings(),
    # SmolLM2's own replies to ShareGPT's prompts with their stored taps (`python -m minispec.dflash.data`, then
    # `python -m minispec.dflash.taps`), never MT-Bench; lr 3e-3 beat 1e-3 in a paired 150-step probe (held-out
    # tau 1.19 vs 1.15); initialisation from the target, distillation, 2 layers and B = 4 bought no held-out tau
    # in paired 120-step runs (docs/benchmarks.md), so the cheapest of them ships.
    "smollm2-135m": Settings(data="sharegpt", steps=2000, batch=8, lr=3e-3, warmup=100, num_anchors=32, distill=0.0,
                             init_from_target=True, mixed_precision=True, draft_vocab=8192, eval_replies=128,
                             eval_every=400, ckpt_every=200),
}
CONFIGS = {"bolt-mini": bolt_mini_dflash_config, "smollm2-135m": smollm2_dflash_config}


def freeze(target) -> None:
    """The target is fixed: no gradients into it, nor into the embedding / head the drafter borrows."""
    target.eval()
    target.requires_grad_(False)


@dataclass
class TapFeatures:
    """A target's replies with its tapped hidden states, computed once (`tap_features`)."""
    replies: Replies
    features: torch.Tensor  # [n, S, n_taps * Ht] bf16: F at every position of every row
    lengths: torch.Tensor  # [n] real tokens of each row (prompt and reply), the rest is padding

    def __len__(self) -> int:
        return len(self.replies)


def batch_at(dataset: torch.Tensor | Replies | TapFeatures | TapSet, s: Settings, step: int):
    """Step `step`'s batch (x [Bs, S], loss_mask [Bs, S], features [Bs, S, F] or None, final [Bs, S, H] or
    None): rows of `Replies` (loss on reply tokens only; with their stored features, cut to the batch's longest
    row), samples of a `TapSet` (with the target head's stored input, `final`), or windows of a token stream
    (loss everywhere). Seeded by (seed, step), so resuming is exact."""
    if isinstance(dataset, TapSet):
        b = dataset.batch(s.batch, s.seed, step)
        return b.input_ids, b.loss_mask, b.features, b.final
    if isinstance(dataset, TapFeatures):
        rows = batch_rows(len(dataset), s.batch, s.seed, step)
        S = int(dataset.lengths[rows].max())
        return (dataset.replies.input_ids[rows, :S], dataset.replies.loss_mask[rows, :S],
                dataset.features[rows, :S], None)
    if isinstance(dataset, Replies):
        return (*dataset.batch(s.batch, s.seed, step), None, None)
    x = data.random_windows(dataset, s.batch, s.seq_len, s.seed, step)
    return x, torch.ones_like(x), None, None


@torch.no_grad()
def tap_features(target, drafter: DFlashDraftModel, replies: Replies, batch_size: int = 8,
                 cache: bool = True) -> TapFeatures:
    """Run the frozen target once over every row of `replies` and keep the drafter's taps, cached on disk
    by the target's weights, the replies and the tap ids."""
    lengths = replies.loss_mask.cumsum(1).argmax(1) + 1  # rows are prompt, reply, padding: cut after the reply
    ids = hashlib.sha256(replies.input_ids.numpy().tobytes() + replies.loss_mask.numpy().tobytes()).hexdigest()
    key = f"{weights_digest(target)}-{ids[:16]}-{'_'.join(map(str, drafter.config.target_layer_ids))}"
    path = cache_dir() / "features" / f"{key}.pt"
    if cache and path.exists():
        return TapFeatures(replies, torch.load(path), lengths)
    n, S = replies.input_ids.shape
    features = torch.zeros(n, S, drafter.config.num_taps * drafter.config.target_hidden_size, dtype=torch.bfloat16)
    for i in tqdm(range(0, n, batch_size), desc="target taps"):
        L = int(lengths[i: i + batch_size].max())
        out = target(input_ids=replies.input_ids[i: i + batch_size, :L], output_hidden_states=True)
        real = torch.arange(L)[None, :, None] < lengths[i: i + batch_size, None, None]
        # Zero past each row's end, so that a row's features do not depend on the rows batched with it.
        features[i: i + batch_size, :L] = (drafter.tap(out.hidden_states) * real).to(torch.bfloat16)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(features, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
    return TapFeatures(replies, features, lengths)


def frequent_tokens(reply_tokens: torch.Tensor, num: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `num` most frequent of the reply tokens [n] (ties to the lower id), always including `always` (e.g.
    EOS)."""
    counts = torch.bincount(reply_tokens, minlength=max([int(reply_tokens.max()), *always]) + 1)
    counts[list(always)] = counts.max() + 1
    return counts.argsort(descending=True, stable=True)[:num].sort().values


def sample_blocks(x: torch.Tensor, loss_mask: torch.Tensor, drafter: DFlashDraftModel, s: Settings,
                  step: int) -> dmask.Blocks:
    """This step's anchors (seeded by (seed, step), so a resumed run draws the same ones) and their blocks."""
    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step + 500_009)
    T = drafter.config.block_size
    anchors, valid = dmask.sample_anchors(loss_mask, T, s.num_anchors, g)
    return dmask.make_blocks(x, anchors, valid, T, drafter.config.mask_token_id, loss_mask=loss_mask, gamma=s.gamma)


def soft_loss(logits: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * CE(softmax(teacher), logits)) / sum(w): the soft-label version of `mask.dflash_loss`."""
    ce = -(teacher.float().softmax(-1) * logits.float().log_softmax(-1)).sum(-1)
    w = weights.to(ce.dtype)
    return (w * ce).sum() / w.sum().clamp(min=torch.finfo(ce.dtype).tiny)


def teacher_logits(target_logits: torch.Tensor, blocks: dmask.Blocks) -> torch.Tensor:
    """[Bs, S, V] target logits (or any per-position states) -> [Bs, N, T, V]: token a + k is predicted at
    position a + k - 1."""
    S, V = target_logits.shape[1:]
    index = (blocks.positions - 1).clamp(0, S - 1).flatten(1)  # k = 0 has weight 0; clamped past the end
    return target_logits.gather(1, index[..., None].expand(-1, -1, V)).view(*blocks.positions.shape, V)


def step_loss(drafter: DFlashDraftModel, target, x: torch.Tensor, loss_mask: torch.Tensor, s: Settings, step: int,
              features: torch.Tensor | None = None, rows: slice = slice(None), processes: int = 1,
              final: torch.Tensor | None = None, details: dict | None = None):
    """(loss, weighted accuracy) of one batch x [Bs, S] whose tokens with loss_mask = 1 carry loss; the
    target runs here unless the batch brings its stored tap `features` [Bs, S, F]. With `final` [Bs, S, H]
    (the input of the target's head, stored beside the taps) distillation reads the target's logits over the
    draft vocabulary from it instead of from a target forward. `details`, if given, receives this batch's
    logits, labels, weights and blocks (for `evaluate`).

    rows, processes: compute only these rows, one of `processes` equal shards (data parallelism). The anchors
    are drawn for the whole batch and both numbers are normalized by the whole batch's weights, times
    `processes`, so that their mean over the processes (what DistributedDataParallel does with the gradients)
    is the whole batch's weighted mean."""
    device = next(drafter.parameters()).device
    x, loss_mask = x.to(device), loss_mask.to(device)
    blocks = sample_blocks(x, loss_mask, drafter, s, step)
    total = (blocks.weights * (drafter.to_draft_ids(blocks.labels) >= 0)).sum()
    blocks = dmask.Blocks(*(getattr(blocks, f.name)[rows] for f in fields(dmask.Blocks)))
    x = x[rows]
    out = None
    if features is None:
        with torch.no_grad():
            out = target(input_ids=x, output_hidden_states=True)
        features = drafter.tap(out.hidden_states)
    else:
        features = features[rows].to(device)
    logits = drafter(features, blocks)  # [Bs, N, T, Vd]
    labels = drafter.to_draft_ids(blocks.labels)
    weights = blocks.weights * (labels >= 0)  # a token outside the draft vocabulary cannot be drafted
    labels = labels.clamp(min=0)
    loss = dmask.dflash_loss(logits, labels, weights) if s.distill < 1 else 0.0
    if s.distill > 0:
        if final is not None:
            # The target's distribution restricted to the draft vocabulary (renormalised there by the softmax).
            teacher = drafter.output_logits(teacher_logits(final[rows].to(device), blocks).to(drafter.dtype))
        elif out is None or drafter.config.draft_vocab_size is not None:
            raise ValueError("distill > 0 needs the target's logits: stored final states (data sharegpt) or a live "
                             "target over the whole vocabulary (not cache_features, not draft_vocab)")
        else:
            teacher = teacher_logits(out.logits, blocks)
        loss = (1 - s.distill) * loss + s.distill * soft_loss(logits, teacher, weights)
    if details is not None:
        details.update(logits=logits.detach(), labels=labels, weights=weights, blocks=blocks)
    share = processes * float(weights.sum() / total.clamp(min=torch.finfo(weights.dtype).tiny))
    return loss * share, dmask.weighted_accuracy(logits.detach(), labels, weights) * share


@torch.no_grad()
def reply_runs(drafter: DFlashDraftModel, input_ids: torch.Tensor, loss_mask: torch.Tensor, features: torch.Tensor,
               gamma: float | None = None) -> list[int]:
    """The leading hits (`mask.leading_hits`) of a block anchored at every position of one reply, from its first
    token to the one before its last: what `mask.walk` walks. input_ids, loss_mask [1, S] (1 on the reply),
    features [1, S, F] (the target's taps), in one drafter forward."""
    reply = loss_mask[0].nonzero()[:, 0]
    P, n = int(reply[0]), int(reply[-1]) + 1
    anchors = torch.arange(P, n - 1)[None]
    if anchors.numel() == 0:
        return []
    blocks = dmask.make_blocks(input_ids[:, :n], anchors, torch.ones_like(anchors, dtype=torch.bool),
                               drafter.config.block_size, drafter.config.mask_token_id, loss_mask=loss_mask[:, :n],
                               gamma=gamma)
    labels = drafter.to_draft_ids(blocks.labels)
    runs = dmask.leading_hits(drafter(features[:, :n], blocks), labels.clamp(min=0), blocks.weights * (labels >= 0))
    return runs[0].tolist()


def walk_replies(drafter: DFlashDraftModel, b, rows: list[int], s: Settings) -> tuple[int, int]:
    """(tokens, cycles) of the loop's walk (`mask.walk`) through the replies `rows` of a `TapSet` batch."""
    tokens = cycles = 0
    for r in rows:
        runs = reply_runs(drafter, b.input_ids[r: r + 1], b.loss_mask[r: r + 1], b.features[r: r + 1], s.gamma)
        tokens, cycles = tokens + len(runs), cycles + len(dmask.walk(runs))
    return tokens, cycles


@torch.no_grad()
def evaluate(drafter: DFlashDraftModel, target, windows: torch.Tensor | Replies | TapSet, s: Settings,
             rows: int | None = None) -> dict[str, float]:
    """Mean loss and weighted accuracy over `[n, L]` windows (loss everywhere), `Replies`, or the first `rows`
    samples of a `TapSet` (default: `s.eval_replies`), with fixed anchors (step -1's). On a `TapSet` also
    `tau`: greedy verification's tau over the blocks of its greedy replies (`mask.acceptance_length`), and
    `loop_tau`: the loop's tokens per cycle walked through those replies (`mask.walk`)."""
    drafter.eval()
    if isinstance(windows, TapSet):
        n = min(len(windows), rows or s.eval_replies)
        losses, accs, taus, blocks, walked = [], [], [], [], [0, 0]
        for i in range(0, n, s.batch):
            b = windows.rows(list(range(i, min(i + s.batch, n))))
            seen = {}
            loss, acc = step_loss(drafter, target, b.input_ids, b.loss_mask, s, -1, b.features, final=b.final,
                                  details=seen)
            losses.append(float(loss))
            accs.append(acc)
            greedy = b.temperatures == 0
            tau, count = dmask.acceptance_length(seen["logits"][greedy], seen["labels"][greedy],
                                                 seen["weights"][greedy], seen["blocks"].valid[greedy])
            taus.append(tau * count)
            blocks.append(count)
            walked = [w + v for w, v in zip(walked, walk_replies(drafter, b, greedy.nonzero()[:, 0].tolist(), s))]
        return {"loss": sum(losses) / len(losses), "accuracy": sum(accs) / len(accs),
                "tau": sum(taus) / max(sum(blocks), 1), "loop_tau": walked[0] / max(walked[1], 1)}
    if not isinstance(windows, Replies):
        windows = Replies(windows, torch.ones_like(windows))
    losses, accs = [], []
    for i in range(0, len(windows), s.batch):
        x, loss_mask = windows.input_ids[i: i + s.batch], windows.loss_mask[i: i + s.batch]
        loss, acc = step_loss(drafter, target, x, loss_mask, s, step=-1)  # the target runs: eval rows are few
        losses.append(float(loss))
        accs.append(acc)
    return {"loss": sum(losses) / len(losses), "accuracy": sum(accs) / len(accs)}


@torch.no_grad()
def init_from_target(drafter: DFlashDraftModel, target, tap_rms: torch.Tensor) -> list[str]:
    """Start the drafter near the target instead of at random (returns the names of the copied tensors):

    * each drafter layer i starts as the target's layer L - n + i (its last n layers), tensor by tensor where
      the names and shapes match (a Llama layer has no q_norm / k_norm: those stay at ones);
    * the final norm is the target's (SmolLM2's has mean 1.80; a drafter norm at ones would start its logits
      1.8x too flat);
    * fc divides each tap feature by its RMS (`tap_rms`, measured without position 0): SmolLM2's tap of layer
      27 carries 80 % of the concatenated energy and a few features are near-constant offsets hundreds of
      times larger than the rest; scaled, every feature enters fc at a comparable size.
    """
    if target.config.model_type != "llama":
        raise ValueError(f"init_from_target copies a Llama target's layers and norms; this target is "
                         f"{target.config.model_type!r}, whose layers and norms it has not been checked against")
    layers = target.model.layers
    copied = []
    for i, layer in enumerate(drafter.layers):
        source = layers[len(layers) - len(drafter.layers) + i].state_dict()
        for name, tensor in layer.state_dict().items():
            if name in source and source[name].shape == tensor.shape:
                tensor.copy_(source[name])
                copied.append(f"layers.{i}.{name}")
    drafter.norm.weight.copy_(target.model.norm.weight)
    drafter.fc.weight.div_(tap_rms.to(drafter.fc.weight)[None, :] / tap_rms.mean())
    return copied + ["norm.weight"]


def make_optimizer(drafter: DFlashDraftModel, s: Settings) -> torch.optim.AdamW:
    params = [p for p in drafter.parameters() if p.requires_grad]  # the drafter's own weights only
    return training.adamw(params, s)


def train(drafter: DFlashDraftModel, target, dataset: torch.Tensor | Replies | TapFeatures, s: Settings, work_dir: Path,
          stop_after: int | None = None, desc: str = "train dflash", on_step=None,
          must_match: dict | None = None) -> list[dict]:
    """Train `drafter` (attached to `target`) in place on `dataset`: the target's `Replies` (loss on the
    reply tokens), the same with their stored taps (`TapFeatures`), or windows of a token stream [n].

    Resumes from `work_dir/train_state.pt`. `stop_after` ends the run early (after that step count,
    with a checkpoint), as an interruption would. `on_step(step, record)` is called after every step
    (a notebook's live plot hooks in here). `must_match`: what a resumed run must share with the saved one
    besides its settings (`training.train_loop`). Returns the history: per step {"loss", "accuracy"}.
    """
    freeze(target)
    drafter.attach_target(target)

    def batch_loss(step: int):
        x, loss_mask, features, final = batch_at(dataset, s, step)
        with torch.autocast(next(drafter.parameters()).device.type, torch.bfloat16, enabled=s.mixed_precision):
            loss, acc = step_loss(drafter, target, x, loss_mask, s, step, features, distributed.shard_of(s.batch),
                                  distributed.world_size(), final)
        return loss, {"loss": loss.item(), "accuracy": acc}

    return training.train_loop({"model": drafter}, make_optimizer(drafter, s), s, batch_loss,
                               Path(work_dir) / "train_state.pt", stop_after=stop_after, on_step=on_step, desc=desc,
                               must_match=must_match)


def training_replies(target, tokenizer, s: Settings, split: str = "train") -> Replies:
    """The target's greedy and sampled (T = 1) replies, cached on disk: to windows of the `split` corpus for a
    plain LM, to instruction prompts (`minispec.targets.instructions`, stdlib `split`) for a chat model."""
    def replies(n: int, temperature: float, seed: int) -> Replies:
        if tokenizer.chat_template is not None:
            return instruction_replies(target, tokenizer, n, s.reply_len, temperature, seed=seed, split=split)
        return generate_replies(target, tokenizer, n, s.prompt_len, s.reply_len, temperature, split=split, seed=seed)

    parts = [replies(n, temperature, s.seed + i)
             for i, (n, temperature) in enumerate([(s.greedy_replies, 0.0), (s.sampled_replies, 1.0)]) if n]
    return concatenate(parts, special_ids(target)[0])


def init_drafter(path: Path) -> tuple[Path, DFlashDraftModel]:
    """--init-from: the resolved folder of a saved DFlash drafter and its model, or an error naming the path."""
    from minispec.dflash.export import load_drafter_model

    folder = Path(path).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--init-from {path}: no saved drafter there ({folder / 'config.json'} does not "
                                "exist)")
    if not is_dflash_folder(folder):
        kind = json.loads((folder / "config.json").read_text()).get("model_type", "unknown")
        raise ValueError(f"--init-from {path} is a target model (model_type {kind!r}), not a DFlash drafter: name "
                         "the folder of a drafter that `python -m minispec.dflash.train` saved")
    return folder, load_drafter_model(folder)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.dflash.train", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="bolt-mini", choices=sorted(CONFIGS))
    p.add_argument("--out", type=Path, help="output folder (default: ~/.cache/minispec/models/<target>-dflash; the "
                                            "shipped one is rebuilt with --out minispec/checkpoints/<target>-dflash)")
    p.add_argument("--work-dir", type=Path, help="where resumable train state lives")
    p.add_argument("--init-from", type=Path, help="start from this saved drafter's weights (a second stage)")
    training.add_settings_arguments(p, Settings, help="default: per target ({} for bolt-mini)")
    a = p.parse_args(argv)
    s = training.settings_from_args(p, a, SETTINGS[a.target])
    out = a.out or training.default_out(f"{a.target}-dflash")
    work_dir = a.work_dir or cache_dir() / "train" / f"{a.target}-dflash"
    init_from, start = init_drafter(a.init_from) if a.init_from is not None else (None, None)

    target, tok = load_target(a.target)
    freeze(target)
    torch.manual_seed(s.seed)
    shape = {k: v for k, v in (("num_hidden_layers", s.num_layers), ("block_size", s.block_size),
                               ("target_layer_ids", s.tap_layer_ids)) if v}
    drafter = DFlashDraftModel.for_target(CONFIGS[a.target](draft_vocab_size=s.draft_vocab or None, **shape), target)
    if s.data == "sharegpt":
        folder = DATASETS / f"{a.target}-sharegpt"
        taps = taps_dir(folder, drafter.config.target_layer_ids)
        shards = shard_slice(s.train_shards) if s.train_shards else slice(None)
        dataset, val = TapSet(folder, taps, "train", shards), TapSet(folder, taps, "heldout")
        reply_tokens = dataset.reply_token_ids()
        train_data = (f"{folder.name}: {len(dataset.tokens)} train shards ({s.train_shards or 'all'}), "
                      f"{len(dataset)} replies")
    else:
        if s.init_from_target:
            raise ValueError("init_from_target measures the taps' statistics on stored taps: use --data sharegpt")
        with distributed.main_first():  # under torchrun: rank 0 generates (and caches) the replies, the others read
            replies = training_replies(target, tok, s)
        reply_tokens = replies.input_ids[replies.loss_mask.bool()]
        train_data = f"corpus {corpus.data_hash(corpus.iter_files('train'))[:16]}, {len(replies)} replies"
    if s.draft_vocab:
        eos = special_ids(target)[1]
        drafter.set_draft_vocab(frequent_tokens(reply_tokens, s.draft_vocab, always=() if eos is None else (eos,)))
    if s.init_from_target:
        init_from_target(drafter, target, dataset.tap_rms(seed=s.seed))
    previous = None
    if start is not None:
        try:
            drafter.load_state_dict({k: v.to(drafter.dtype) for k, v in start.state_dict().items()})
        except RuntimeError as e:
            raise ValueError(f"--init-from {a.init_from} does not fit a {a.target} drafter with these settings "
                             f"(it was trained for another target or configuration): {str(e)[:300]}") from None
        if (init_from / "training.json").is_file():
            previous = json.loads((init_from / "training.json").read_text())
    # Measured after --init-from, whose draft vocabulary (that of the data it first trained on) is the one kept.
    coverage = float((drafter.to_draft_ids(reply_tokens) >= 0).float().mean()) if s.draft_vocab else 1.0
    # What a resumed run must share with the saved one besides its settings: the target it trains against and
    # the weights it started from, by folder and by digest (the same folder rewritten since is another start).
    must_match = {"target": weights_digest(target), "init_from": None if init_from is None else str(init_from),
                  "init_weights": None if start is None else weights_digest(start)}
    if s.data == "replies":
        with distributed.main_first():
            dataset = tap_features(target, drafter, replies) if s.cache_features else replies
            val = training_replies(target, tok, replace(s, greedy_replies=s.eval_replies, sampled_replies=0),
                                   split="val")
    target.to(distributed.device())  # this process's GPU when there are GPUs; the drafter shares its embedding
    drafter.to(distributed.device())
    def evaluate_every(step: int, record: dict) -> None:
        # Into the step's record, which the resumable state keeps: a resumed run keeps its curve.
        if s.eval_every and (step + 1) % s.eval_every == 0 and distributed.is_main():
            record.update({f"val_{k}": v for k, v in evaluate(drafter, target, val, s).items()},
                          cpu_seconds=time.process_time())

    history = train(drafter, target, dataset, s, work_dir, must_match=must_match, on_step=evaluate_every)
    metrics = evaluate(drafter, target, val, s)
    drafter.to("cpu", torch.bfloat16)  # bf16 on disk, like every shipped checkpoint
    recent = history[-100:]
    record = {
        "command": "python -m minispec.dflash.train " + shlex.join(sys.argv[1:] if argv is None else argv),
        "target": a.target,
        "settings": asdict(s),
        "train_data": train_data,
        "train_replies_sha256": hashlib.sha256(reply_tokens.numpy().tobytes()).hexdigest(),
        "train_reply_tokens": len(reply_tokens),
        "draft_vocab_coverage": coverage,  # share of the training reply tokens the draft vocabulary holds
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "parameters": num_parameters(drafter),
        "final_train_loss_avg100": sum(h["loss"] for h in recent) / len(recent),
        "final_train_accuracy_avg100": sum(h["accuracy"] for h in recent) / len(recent),
        "val_loss": metrics["loss"],
        "val_weighted_accuracy": metrics["accuracy"],
        "val_tau_greedy_blocks": metrics.get("tau"),
        "val_loop_tau": metrics.get("loop_tau"),
        "val_data": (f"the first {min(len(val), s.eval_replies)} held-out ShareGPT replies" if s.data == "sharegpt"
                     else f"{len(val)} greedy replies of up to {s.reply_len} tokens to val-split prompts"),
        "loss_history_every_10": [h["loss"] for h in history[::10]],
        "val_history": [{"step": i + 1, **{k: v for k, v in h.items() if k.startswith("val_") or k == "cpu_seconds"}}
                        for i, h in enumerate(history) if "val_loss" in h],  # cpu_seconds of this process
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_seconds": round(time.process_time(), 1),  # the whole process, every thread: loading and evaluation too
        "previous_stage": previous,  # the run this one started from (--init-from), or None
    }

    def write(folder: Path) -> None:
        drafter.save_pretrained(folder)
        (folder / "training.json").write_text(json.dumps(record, indent=1))

    training.save_atomically(out, write)
    if distributed.is_main():
        print(f"val loss {metrics['loss']:.4f}  weighted accuracy {metrics['accuracy']:.4f}")
        print(f"saved {out}; load it with ms.load_drafter({str(out)!r}, target)")


if __name__ == "__main__":
    main()
