"""The MTP story of the Super/Lightning paper ("Nemotron 3.5 Super and Lightning: Open, Efficient
Mixture-of-Experts Hybrid Mamba-Transformer Models for Agentic AI") at lightning-mini scale, one package
script per stage:

    python -m minispec.mtp.stages sft         1. joint SFT: the pretrained lightning-mini and a fresh MTP head
                                                 trained together (LM loss + 0.1 x per-depth MTP loss); the
                                                 result *is* the shipped lightning-mini (backbone + mtp.*)
    python -m minispec.mtp.stages posttrain   2. the backbone trained further on a shifted slice (the
                                                 stdlib's unit tests); the head is not updated
    python -m minispec.mtp.stages boost       3. the stale head re-aligned to the post-trained backbone:
                                                 frozen backbone, its own T = 1 replies, per-depth KL,
                                                 hidden-state mixing on (shipped) and off (plain unrolling)
    python -m minispec.mtp.stages eval        4. every head at T = 0 and T = 1 (sampled and argmax drafts)
    python -m minispec.mtp.stages hsm         4b. what each depth reads in training, four arms over paired
                                                 seeds: depth 1 only, unrolled, HSM, exact TTT (stitched)
    python -m minispec.mtp.stages transfer    4c. the paper's transfer experiment: boost on the SFT-stage
                                                 backbone, move the head unchanged onto the post-trained
                                                 one, then a short top-up there; AL after each

Where each stage reads and writes (every write is one `training.save_atomically` step):

    sft        reads --pretrained (default ~/.cache/minispec/models/lightning-mini, where
               `python -m minispec.targets.train lightning-mini` saves), writes backbone + head into --out
               (default: that same cache folder), keeping the pretraining record under `previous_stage`
    posttrain  reads --sft (default: the shipped lightning-mini), writes a new lightning-mini-post into --out
    boost      reads --sft's head and --post's backbone (default: the shipped lightning-mini-post), writes a copy
               of --post with the three heads into --out
    eval       reads --sft and --post, writes a copy of --post with mtp_eval.json into --out
    hsm, transfer  read --sft and --post, write one results JSON: --out names the file (default
               ~/.cache/minispec/mtp/mtp-hsm-study.json / mtp-transfer.json; the notebook reads
               minispec/results/)

--out defaults to the user cache (~/.cache/minispec/models/lightning-mini or lightning-mini-post); the shipped
folders are rebuilt only when --out names them (`--out minispec/checkpoints/lightning-mini-post`). Every stage
trains with `minispec.training.train_loop`: seeded, tqdm, resumable from `train_state.pt` in its work dir.
"""
from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from minispec import cli, training
from minispec.files import cache_dir
from minispec.mtp.backbone import Backbone
from minispec.mtp.head import MTPConfig, MTPHead
from minispec.mtp.sft import joint_loss
from minispec.targets import corpus, data
from minispec.targets.load import CHECKPOINTS
from minispec.targets.replies import Replies, generate_replies
from minispec.targets.tokenizer import load_shipped_tokenizer
from minispec.targets.train import next_token_loss

SFT_FOLDER = CHECKPOINTS / "lightning-mini"  # the stage-1 head lives beside its backbone (mtp.*)
POST_FOLDER = CHECKPOINTS / "lightning-mini-post"  # the post-trained backbone + its boosted head
SHIFT_PREFIX = "test/"  # the post-training slice: unit tests, a different register from library code


def work_root() -> Path:
    return cache_dir() / "mtp"


def head_config(backbone_config) -> MTPConfig:
    """Nemotron 3.5's head layout ("*E": attention then MoE) at a size that ships small (~0.4 M params)."""
    return MTPConfig.like(backbone_config, pattern="*E", head_dim=32, moe_intermediate_size=64,
                          moe_shared_expert_intermediate_size=64)


def load_backbone(folder: Path = SFT_FOLDER):
    from minispec.ssm.hybrid import HybridLM

    model = HybridLM.from_pretrained(folder).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def shifted_stream(tok) -> torch.Tensor:
    """The post-training slice: train-split files under `SHIFT_PREFIX`, as one `<bos> file <eos>` stream."""
    ids: list[int] = []
    for f in corpus.iter_files("train"):
        if f.relpath.startswith(SHIFT_PREFIX):
            ids += [tok.bos_token_id, *tok(f.text)["input_ids"], tok.eos_token_id]
    if not ids:
        raise ValueError(f"no train files under {SHIFT_PREFIX!r} in this Python's stdlib")
    return torch.tensor(ids)


def _record(folder: Path, name: str, command: str, record: dict) -> None:
    record = {"command": command, **record, "torch": torch.__version__,
              "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    (folder / name).write_text(json.dumps(record, indent=1))


# -- stage 1 -------------------------------------------------------------------------------------
@dataclass
class SFTSettings(training.Settings):
    lr: float = 2e-3  # the fresh head
    warmup: int = 20
    weight_decay: float = 0.1  # backbone matrices only
    ckpt_every: int = 25
    seq_len: int = 256
    depths: int = 3
    mtp_weight: float = 0.1  # Megatron-LM's mtp_loss_scaling_factor default
    backbone_lr: float = 5e-4  # the pretrained backbone, fine-tuned (same schedule, scaled)


def train_sft(model, s: SFTSettings, work_dir: Path, stop_after: int | None = None) -> tuple[MTPHead, list]:
    """Stage 1: `model` (the pretrained backbone, trained in place) and a fresh head trained together on
    corpus windows with `joint_loss`: LM cross-entropy + mtp_weight · mean per-depth CE. A resumed run must
    start from the same pretrained weights ("origin")."""
    origin = training.weights_digest(model)
    torch.manual_seed(s.seed)
    head = MTPHead(head_config(model.config))
    for p in model.parameters():
        p.requires_grad_(True)
    groups = training.weight_decay_groups(model.parameters(), s.weight_decay)
    backbone = [{**g, "scale": s.backbone_lr / s.lr} for g in groups]  # train_loop: lr x a group's "scale"
    opt = torch.optim.AdamW([{"params": list(head.parameters()), "weight_decay": 0.0, "scale": 1.0}, *backbone],
                            lr=s.lr, betas=(0.9, 0.95))
    stream = data.token_stream("train", load_shipped_tokenizer())

    def batch_loss(step: int):
        x = data.random_windows(stream, s.batch, s.seq_len, s.seed, step)
        res = joint_loss(model, head, x, s.depths, s.mtp_weight)
        return res.loss, {"lm": res.lm.item(), "ce": res.mtp.tolist(), "accuracy": res.mtp_accuracy.tolist()}

    history = training.train_loop({"model": model, "head": head}, opt, s, batch_loss, work_dir / "train_state.pt",
                                  stop_after=stop_after, desc="stage 1: joint SFT (backbone + head)",
                                  must_match={"origin": origin})
    return head, history


def pretrained_backbone(folder: Path) -> tuple[object, dict]:
    """Stage 1's starting point and its training record: lightning-mini as `minispec.targets.train` left it
    (float32, trainable). A folder that already holds the joint SFT stage is refused: starting over needs
    the pretraining rerun."""
    from transformers import AutoModelForCausalLM

    if not (folder / "training.json").is_file():
        raise FileNotFoundError(f"no pretrained lightning-mini in {folder} (no training.json): run `python -m "
                                f"minispec.targets.train lightning-mini --out {folder}` first")
    record = json.loads((folder / "training.json").read_text())
    if "previous_stage" in record:
        raise ValueError(f"{folder} already holds the joint SFT stage ({record['command']!r}); stage 1 starts "
                         "from the pretrained model: run `python -m minispec.targets.train lightning-mini` first")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), record


def save_head(head: MTPHead, folder: Path) -> None:
    """bf16 on disk, as every shipped checkpoint (the head is loaded back in the backbone's dtype)."""
    shipped = MTPHead(head.config)
    shipped.load_state_dict(head.state_dict())
    shipped.to(torch.bfloat16).save_pretrained(folder)


# -- stage 2 -------------------------------------------------------------------------------------
@dataclass
class PostSettings(training.Settings):
    steps: int = 60
    batch: int = 4
    weight_decay: float = 0.1
    ckpt_every: int = 20
    seq_len: int = 128


def post_train(s: PostSettings, work_dir: Path, stop_after: int | None = None, sft: Path = SFT_FOLDER):
    """Stage 2: lightning-mini (transformers' NemotronH, the format it ships in; from folder `sft`) trained
    further on the shifted slice with the LM loss. Returns the HF model (float32) and the loss history."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(s.seed)
    model = AutoModelForCausalLM.from_pretrained(sft, dtype=torch.float32)
    stream = shifted_stream(load_shipped_tokenizer())
    # a resumed run must post-train the same stage-1 backbone ("origin")
    history = training.train_loop({"model": model}, training.adamw(model.parameters(), s), s,
                                  next_token_loss(model, stream, s), work_dir / "train_state.pt",
                                  stop_after=stop_after, desc="stage 2: post-train backbone",
                                  must_match={"origin": training.weights_digest(model)})
    return model, history


# -- stage 3's data ------------------------------------------------------------------------------
def corpus_replies(model, num: int = 512, prompt_len: int = 48, reply_len: int = 48, seed: int = 0) -> Replies:
    """Stage 3's data: `num` seeded train-split prompts and the model's T = 1 replies, cached on disk."""
    return generate_replies(model, load_shipped_tokenizer(), num, prompt_len, reply_len, temperature=1.0, seed=seed,
                            prompt_step=-11)


# -- stage 4 -------------------------------------------------------------------------------------
SIGNAL_DEPTHS = 5
EVAL_KS = (3, 7)  # the depth the heads train at, and Nebius' drafting depth (nebius/MTP-DeepSeek-V3-0324)
MODES = (("T=0", 0.0, False), ("T=1 sampled", 1.0, False), ("T=1 argmax", 1.0, True))


def acceptance(model, head: MTPHead, prompts: list[torch.Tensor], k: int = 3, max_new_tokens: int = 32,
               seed: int = 0, modes=MODES) -> dict[str, dict]:
    """AL (τ: tokens per target forward) and per-position acceptance of `head` drafting for `model`,
    batch 1 over `prompts`, per mode: T = 0; T = 1 with drafts sampled from q and full-q rejection;
    T = 1 with argmax drafts (q one-hot)."""
    import minispec as ms
    from minispec.mtp.drafter import MTPDrafter
    from minispec.speculative.stats import SpecStats

    out = {}
    for name, temperature, argmax in modes:
        drafter = MTPDrafter(head, model, num_draft_tokens=k, argmax_drafts=argmax)
        generator = torch.Generator().manual_seed(seed)
        runs = [ms.speculative_generate(model, drafter, p[None], max_new_tokens, temperature=temperature,
                                        generator=generator) for p in prompts]
        stats = SpecStats([c for r in runs for c in r.stats.cycles])
        out[name] = {"tau": stats.tau, "per_position": stats.per_position.tolist()}
    return out


@torch.no_grad()
def signal(model, head: MTPHead, replies, depths: int = SIGNAL_DEPTHS, context: str = "stitched"
           ) -> dict[str, list[float]]:
    """Per-depth KL(backbone ‖ head) and 1 − TV on reply tokens, past the 3 depths the heads train (Figure
    6's "later positions"). In the stitched context (default) every depth reads exactly what it reads when
    drafting, so 1 − TV at depth k is the acceptance rate of a sampled draft there, given the earlier drafts
    were the reply's tokens; "unrolled" is how mtp_eval.json's signal was recorded."""
    from minispec.mtp.boost import boost_loss

    res = boost_loss(head, Backbone.of(model), replies.input_ids, depths, loss_mask=replies.loss_mask,
                     context=context)
    return {"kl": res.kl.tolist(), "one_minus_tv": res.acceptance.tolist()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m minispec.mtp.stages", description=__doc__.splitlines()[0])
    p.add_argument("stage", choices=("sft", "posttrain", "boost", "eval", "hsm", "transfer"))
    p.add_argument("--steps", type=cli.positive_int, help="override the stage's step count")
    p.add_argument("--eval-prompts", type=cli.positive_int, default=48, help="eval-set prompts for stage 4 (batch 1 "
                                                                              "each)")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=32)
    p.add_argument("--seeds", type=cli.positive_int, default=3, help="boosting seeds per arm for `hsm`")
    p.add_argument("--topup-steps", type=cli.positive_int, help="transfer: the top-up's steps (default steps / 8)")
    p.add_argument("--pretrained", type=Path, help="sft: the pretrained lightning-mini (default: "
                                                   "~/.cache/minispec/models/lightning-mini)")
    p.add_argument("--sft", type=Path, default=SFT_FOLDER, help="the stage-1 lightning-mini (default: the shipped one)")
    p.add_argument("--post", type=Path, default=POST_FOLDER, help="the post-trained lightning-mini-post (default: the "
                                                                  "shipped one)")
    p.add_argument("--out", type=Path, help="where the stage saves (default: ~/.cache/minispec/models/lightning-mini "
                                            "for sft, .../lightning-mini-post for posttrain, boost, eval; for hsm "
                                            "and transfer a JSON file, default ~/.cache/minispec/mtp/mtp-*.json)")
    args = p.parse_args(argv)
    args.command = "python -m minispec.mtp.stages " + shlex.join(sys.argv[1:] if argv is None else argv)
    reads = {"sft": (), "posttrain": ("sft",)}.get(args.stage, ("sft", "post"))
    for name in reads:
        folder = getattr(args, name)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--{name} {folder}: no model there ({folder / 'config.json'} does not exist)")
    run = {"sft": run_sft, "posttrain": run_posttrain, "boost": run_boost, "eval": run_eval, "hsm": run_hsm,
           "transfer": run_transfer}
    out = run[args.stage](args)
    print(f"saved {out}" if out.suffix == ".json" else f"saved {out}; load it with ms.load_target({str(out)!r})")


def run_sft(args) -> Path:
    """Stage 1 writes its backbone and head in place of the pretrained lightning-mini (by default the same
    folder): the shipped lightning-mini *is* the SFT stage, its pretraining record kept under `previous_stage`."""
    from minispec.targets.train import evaluate

    s = SFTSettings() if args.steps is None else SFTSettings(steps=args.steps)
    work_dir = work_root() / "sft-joint"
    model, previous = pretrained_backbone(args.pretrained or training.default_out("lightning-mini"))
    head, history = train_sft(model, s, work_dir)
    model = model.to(torch.bfloat16).to(torch.float32)  # measure the weights that ship (bf16)
    val = evaluate(model, data.sequential_windows(data.token_stream("val", load_shipped_tokenizer()), 512, 64))
    last = history[-20:]
    record = {
        "stage": "1: joint SFT, backbone + MTP head (LM CE + mtp_weight x per-depth CE) on train-split windows",
        "settings": asdict(s), "val_loss": val["loss"], "val_accuracy": val["accuracy"],
        "val_windows": "64 x 512 tokens from the val split (previous_stage's val_loss is on the same windows)",
        "final_avg20": {"lm": sum(h["lm"] for h in last) / len(last),
                        "ce": [sum(h["ce"][k] for h in last) / len(last) for k in range(s.depths)],
                        "accuracy": [sum(h["accuracy"][k] for h in last) / len(last) for k in range(s.depths)]},
        "head_parameters": sum(p.numel() for p in head.parameters()),
        "lm_every_10": [h["lm"] for h in history[::10]], "previous_stage": previous}

    def write(folder: Path) -> None:
        model.to(torch.bfloat16).save_pretrained(folder)
        load_shipped_tokenizer().save_pretrained(folder)
        save_head(head, folder)
        _record(folder, "training.json", args.command, record)

    return training.save_atomically(args.out or training.default_out("lightning-mini"), write)


def run_posttrain(args) -> Path:
    s = PostSettings() if args.steps is None else PostSettings(steps=args.steps)
    model, history = post_train(s, work_root() / "posttrain", sft=args.sft)

    def write(folder: Path) -> None:
        model.to(torch.bfloat16).save_pretrained(folder)
        load_shipped_tokenizer().save_pretrained(folder)
        _record(folder, "training.json", args.command, {
            "stage": f"2: lightning-mini post-trained on train files under {SHIFT_PREFIX!r}", "settings": asdict(s),
            "loss_history": history})

    return training.save_atomically(args.out or training.default_out("lightning-mini-post"), write)


def boost_runs(steps: int | None = None) -> dict:
    """Stage 3's runs, settings per name. Every run starts from the stage-1 head (re-alignment, as Nebius
    boosts the shipped head). "boost-nohsm" unrolls the depths without mixing: each depth reads the one
    before it at every slot, which is not the stitched context drafting reads (boost.py)."""
    from minispec.mtp.train import BoostSettings

    main_steps = 400 if steps is None else steps
    return {"boost-hsm": BoostSettings(steps=main_steps, batch=8, depths=3, context="hsm", lr=2e-3, warmup=10),
            "boost-nohsm": BoostSettings(steps=main_steps, batch=8, depths=3, context="unrolled", lr=2e-3,
                                         warmup=10)}


def head_folder(name: str, post: Path = POST_FOLDER) -> Path:
    """Where stage 3's head `name` lives in the lightning-mini-post folder `post`: the boosted HSM head
    beside its backbone (`mtp.*`), the others under `mtp-heads/`."""
    return post if name == "boost-hsm" else post / "mtp-heads" / name


def run_boost(args) -> Path:
    from minispec.mtp.train import boost

    model = load_backbone(args.post)
    replies = corpus_replies(model)
    heads = {}
    for name, s in boost_runs(args.steps).items():
        head = MTPHead.from_pretrained(args.sft)
        history = boost(head, model, replies, s, work_root() / name, desc=f"stage 3: {name}")
        heads[name] = head, {"stage": f"3: {name} on this backbone", "settings": asdict(s), "final": history[-1],
                             "acceptance_every_10": [h["acceptance"] for h in history[::10]]}

    def write(folder: Path) -> None:
        for name, (head, record) in heads.items():
            save_head(head, head_folder(name, folder))
            _record(head_folder(name, folder), "mtp_training.json", args.command, record)

    return training.save_atomically(args.out or training.default_out("lightning-mini-post"), write,
                                    copy_of=args.post)


def run_eval(args) -> Path:
    import minispec as ms
    from minispec.mtp.boost import distribution_shift

    prompts = ms.load_evalset().prompts[: args.eval_prompts]
    sft, post = load_backbone(args.sft), load_backbone(args.post)
    held_out = corpus_replies(post, num=64, seed=1)
    eval_ids = torch.stack([p[:64] for p in prompts])  # eval prompts hold >= 64 tokens
    shift = {"eval_prompts": distribution_shift(sft, post, eval_ids),
             "post_training_slice": distribution_shift(sft, post, data.random_windows(
                 shifted_stream(load_shipped_tokenizer()), 16, 128, 1, step=-3))}
    heads = {"stage-1 (SFT) head": MTPHead.from_pretrained(args.sft)}
    for name in boost_runs():
        heads[name] = MTPHead.from_pretrained(head_folder(name, args.post))
    pairs = {"stage-1 head on stage-1 backbone": (sft, heads["stage-1 (SFT) head"])}
    pairs.update({f"{name} on post-trained backbone": (post, head) for name, head in heads.items()})
    rows = {f"K={k}": {} for k in EVAL_KS}
    signals = {}
    for name, (model, head) in tqdm(pairs.items(), desc="stage 4: eval"):
        for k in EVAL_KS:
            rows[f"K={k}"][name] = acceptance(model, head, prompts, k, args.max_new_tokens)
        signals[name] = signal(model, head, held_out if model is post else corpus_replies(sft, num=64, seed=1))
    result = {"eval": f"first {len(prompts)} eval-set prompts, batch 1, {args.max_new_tokens} new tokens; "
                      f"signal: 64 held-out T = 1 replies of the backbone",
              "distribution_shift_kl_new_old": shift, "rows": rows, "signal": signals}
    print(json.dumps(result, indent=1))
    return training.save_atomically(args.out or training.default_out("lightning-mini-post"),
                                    lambda folder: _record(folder, "mtp_eval.json", args.command, result),
                                    copy_of=args.post)


STUDY_MODES = (("T=0", 0.0, False), ("T=1", 1.0, False))  # T = 1: drafts sampled from q, full-q rejection


def hsm_arms(steps: int = 40) -> dict:
    """The study's four arms, one per context a depth reads in training (boost.py), all 3 depths deep but the
    first: depth 1 only (deeper drafts read stand-ins training never showed), unrolled without mixing,
    hidden-state mixing, and the exact stitched context (test-time training)."""
    from minispec.mtp.train import BoostSettings

    base = BoostSettings(steps=steps, batch=8, depths=3, lr=2e-3, warmup=max(1, steps // 10))
    return {"boost-depth1": replace(base, depths=1, context="unrolled"),
            "boost-nohsm": replace(base, context="unrolled"),
            "boost-hsm": replace(base, context="hsm"),
            "boost-ttt": replace(base, context="stitched")}


def measure_head(model, head: MTPHead, held_out, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    """The study's scores of one head: per-depth 1 − TV in the stitched context on `held_out` replies, and
    AL (τ) at K = 3 and 7, T = 0 and T = 1 (sampled drafts), on `prompts` at batch 1."""
    scores = {"one_minus_tv": signal(model, head, held_out)["one_minus_tv"]}
    for k in EVAL_KS:
        for mode, row in acceptance(model, head, prompts, k, max_new_tokens, modes=STUDY_MODES).items():
            scores[f"AL K={k} {mode}"] = row["tau"]
    return scores


def paired(runs: dict[str, list[dict]]) -> dict:
    """Per pair of arms "a - b" and per score: the mean over seeds of the same-seed difference and its
    standard error (NaN with one seed). runs: arm -> one score dict (measure_head) per seed."""
    out = {}
    names = list(runs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            out[f"{a} - {b}"] = {}
            for score in runs[a][0]:
                diff = torch.tensor([ra[score] for ra in runs[a]]) - torch.tensor([rb[score] for rb in runs[b]])
                n = len(diff)
                stderr = diff.std(0) / n ** 0.5 if n > 1 else torch.full_like(diff[0], float("nan"))
                out[f"{a} - {b}"][score] = {"mean": diff.mean(0).tolist(), "stderr": stderr.tolist()}
    return out


def hsm_study(model, start: MTPHead, replies, held_out, prompts: list[torch.Tensor], seeds: int, arms: dict,
              work: Path, max_new_tokens: int = 24) -> dict:
    """`seeds` boosting runs per arm (`arms`: name -> BoostSettings, the seed replaced), each from a copy of
    `start`, scored by `measure_head`. Resumable: a finished run and its scores are kept in `work`/<arm>-seed<n>.
    Returns every run's scores per arm and the paired differences between arms (same seed, same batches)."""
    from minispec.mtp.train import boost

    runs = {name: [] for name in arms}
    for seed in range(seeds):
        for name, settings in arms.items():
            folder = work / f"{name}-seed{seed}"
            scores_file = folder / "scores.json"
            if not scores_file.is_file():
                head = copy.deepcopy(start)
                boost(head, model, replies, replace(settings, seed=seed), folder, desc=f"study: {name} seed {seed}")
                scores_file.write_text(json.dumps(measure_head(model, head.eval(), held_out, prompts,
                                                               max_new_tokens)))
            runs[name].append(json.loads(scores_file.read_text()))
    return {"runs": runs, "paired": paired(runs)}


def write_json(path: Path, record: dict) -> Path:
    """One results JSON, written whole or not at all (a temporary file, then a rename)."""
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return path


def run_hsm(args) -> Path:
    import minispec as ms

    steps = args.steps or 40
    model = load_backbone(args.post)
    prompts = ms.load_evalset().prompts[: args.eval_prompts]
    arms = hsm_arms(steps)
    result = hsm_study(model, MTPHead.from_pretrained(args.sft), corpus_replies(model),
                       corpus_replies(model, num=64, seed=1), prompts, args.seeds, arms, work_root() / "study",
                       args.max_new_tokens)
    result = {"what": f"4 arms boosted from the stage-1 head on lightning-mini-post, {args.seeds} paired seeds each, "
                      f"{steps} steps of batch 8 (3 depths; 1 for boost-depth1); scores: 1 - TV per depth 1..."
                      f"{SIGNAL_DEPTHS} in the stitched context on 64 held-out T = 1 replies, AL (tau) at K = 3 / 7, "
                      f"T = 0 / T = 1 (sampled drafts) on the first {len(prompts)} eval-set prompts, batch 1, "
                      f"{args.max_new_tokens} new tokens",
              "settings": {name: asdict(s) for name, s in arms.items()}, **result}
    print(json.dumps(result["paired"], indent=1))
    _stamp(result, args.command)
    return write_json(args.out or work_root() / "mtp-hsm-study.json", result)


def _stamp(record: dict, command: str) -> None:
    record.update({"command": command, "torch": torch.__version__, "finished": time.strftime("%Y-%m-%d %H:%M:%S")})


def transfer_runs(steps: int = 120, topup_steps: int | None = None) -> dict:
    """The transfer experiment's two boosting runs (HSM, as stage 3): on the SFT-stage backbone, then the
    top-up of that head on the post-trained backbone (default 1/8 of the steps)."""
    from minispec.mtp.train import BoostSettings

    topup = topup_steps or max(1, steps // 8)
    return {"boost-on-sft": BoostSettings(steps=steps, batch=8, depths=3, context="hsm", lr=2e-3,
                                          warmup=max(1, steps // 10)),
            "top-up-on-post": BoostSettings(steps=topup, batch=8, depths=3, context="hsm", lr=2e-3,
                                            warmup=max(1, topup // 10))}


def run_transfer(args) -> Path:
    """The Super/Lightning paper's transfer experiment: the stage-1 head boosted on the SFT-stage backbone
    (lightning-mini), moved unchanged onto the post-trained backbone (lightning-mini-post) and measured,
    then topped up there and measured again."""
    import minispec as ms
    from minispec.mtp.train import boost

    sft, post = load_backbone(args.sft), load_backbone(args.post)
    prompts = ms.load_evalset().prompts[: args.eval_prompts]
    runs = transfer_runs(args.steps or 120, args.topup_steps)
    stale = MTPHead.from_pretrained(args.sft)
    on_sft = copy.deepcopy(stale)
    boost(on_sft, sft, corpus_replies(sft), runs["boost-on-sft"], work_root() / "transfer-boost-on-sft",
          desc="transfer: boost on the SFT backbone")
    topped = copy.deepcopy(on_sft)
    boost(topped, post, corpus_replies(post), runs["top-up-on-post"], work_root() / "transfer-top-up",
          desc="transfer: top-up on the post-trained backbone")
    held_out = {"sft": corpus_replies(sft, num=64, seed=1), "post": corpus_replies(post, num=64, seed=1)}
    rows = {}
    for name, backbone, head in tqdm((("stage-1 head on SFT backbone", "sft", stale),
                                      ("stage-1 head on post-trained backbone", "post", stale),
                                      ("boosted on SFT, on SFT backbone", "sft", on_sft),
                                      ("boosted on SFT, moved unchanged to post-trained", "post", on_sft),
                                      ("moved + top-up on post-trained", "post", topped)), desc="transfer: eval"):
        model = sft if backbone == "sft" else post
        rows[name] = measure_head(model, head.eval(), held_out[backbone], prompts, args.max_new_tokens)
    result = {"what": f"AL (tau) on the first {len(prompts)} eval-set prompts, batch 1, {args.max_new_tokens} new "
                      "tokens, K = 3 / 7, T = 0 / T = 1 (sampled drafts); 1 - TV per depth in the stitched context "
                      "on 64 held-out T = 1 replies of the row's backbone",
              "steps": {name: s.steps for name, s in runs.items()},
              "settings": {name: asdict(s) for name, s in runs.items()},
              "paper": {"what": "AL at T = 1 in the Super/Lightning paper: the head before boosting on the final "
                                "backbone, boosted on the SFT-stage backbone and moved unchanged, then topped up",
                        "AL": [3.787, 4.436, 4.612]},
              "rows": rows}
    print(json.dumps(rows, indent=1))
    _stamp(result, args.command)
    return write_json(args.out or work_root() / "mtp-transfer.json", result)


if __name__ == "__main__":
    main()
