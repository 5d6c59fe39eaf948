"""No training command can lose a shipped checkpoint, and none runs on settings it cannot honour.

* Bad settings (0 or negative counts, no training reply at all, an --init-from that is missing or is not a
  drafter) stop the command before any work, with the flag's name; every file under minispec/checkpoints
  hashes the same after each test here.
* Without --out a command saves into the user cache ($MINISPEC_CACHE/models/<name>), never into the package.
* A folder is replaced only once its new version is complete (`training.save_atomically`): a run that
  fails while saving leaves the old one as it was.
* A resumed run must bring every setting that changes what it computes (--init-from and its weights, the
  QAD recipe); settings that only change the bookkeeping (--ckpt-every) may change.
"""
import functools
import hashlib
import json
import shutil

import pytest
import torch

from minispec import training
from minispec.files import cache_dir
from minispec.manifest import write_manifest
from minispec.targets import data
from minispec.targets.load import CHECKPOINTS
from tiny import save_with_tokenizer, tiny_gemma


def tree_hashes(folder):
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file() and "__pycache__" not in f.parts}


@pytest.fixture(autouse=True)
def shipped_files_unchanged():
    before = tree_hashes(CHECKPOINTS)
    yield
    after = tree_hashes(CHECKPOINTS)
    assert after == before, sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@pytest.fixture(autouse=True, scope="module")
def corpus_read_once():
    """Every run here reads the standard library's files (seconds each): once is enough for the module."""
    from minispec.targets import corpus

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "iter_files", functools.cache(corpus.iter_files))
        yield


@pytest.fixture(scope="module")
def streams(corpus_read_once):
    """The tokenized train and val splits, made once in the real user cache if it lacks them: [their files]."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")
    for split in ("train", "val"):
        data.token_stream(split, tok)
    return list(cache_dir().glob("*.npy"))


@pytest.fixture
def cache(tmp_path, monkeypatch, streams):
    """An empty user cache but for links to the tokenized corpus streams (no test here tokenizes again)."""
    folder = tmp_path / "cache"
    folder.mkdir()
    for stream in streams:
        (folder / stream.name).symlink_to(stream)
    monkeypatch.setenv("MINISPEC_CACHE", str(folder))
    return folder


def targets_main(argv):
    from minispec.targets.train import main

    main(argv)


def dflash_main(argv):
    from minispec.dflash.train import main

    main(argv)


def qad_main(argv):
    from minispec.quant.qad import main

    main(argv)


def stages_main(argv):
    from minispec.mtp.stages import main

    main(argv)


def report_main(argv):
    from minispec.quant.report import main

    main(argv)


TINY_TARGET = ["bolt-nano", "--batch", "1", "--seq-len", "16", "--eval-windows", "1", "--warmup", "1"]
REFUSED_AT_PARSING = [
    (targets_main, ["bolt-nano", "--steps", "0"], "--steps: must be an integer >= 1, got 0"),
    (targets_main, ["bolt-nano", "--batch", "0"], "--batch: must be an integer >= 1, got 0"),
    (targets_main, ["bolt-nano", "--ckpt-every", "0"], "--ckpt-every: must be an integer >= 1, got 0"),
    (targets_main, ["bolt-nano", "--eval-windows", "0"], "--eval-windows: must be an integer >= 1, got 0"),
    (targets_main, ["bolt-nano", "--warmup", "-1"], "--warmup: must be an integer >= 0, got -1"),
    (targets_main, ["bolt-nano", "--lr", "nan"], "--lr: must be a finite number"),
    (targets_main, ["bolt-nano", "--seq-len", "1"], "seq_len must be >= 2"),
    (dflash_main, ["--steps", "0"], "--steps: must be an integer >= 1, got 0"),
    (dflash_main, ["--batch", "0"], "--batch: must be an integer >= 1, got 0"),
    (dflash_main, ["--eval-replies", "0"], "--eval-replies: must be an integer >= 1, got 0"),
    (dflash_main, ["--num-anchors", "-2"], "--num-anchors: must be an integer >= 1, got -2"),
    (dflash_main, ["--greedy-replies", "0", "--sampled-replies", "0"],
     "greedy_replies and sampled_replies are both 0: at least one training reply is needed"),
    (dflash_main, ["--distill", "1.5"], "distill is the weight of the soft-label loss, in [0, 1]"),
    (dflash_main, ["--cache-features", "maybe"], "--cache-features: expected true or false"),
    (qad_main, ["--steps", "0"], "--steps: must be an integer >= 1, got 0"),
    (qad_main, ["--ckpt-every", "0"], "--ckpt-every: must be an integer >= 1, got 0"),
    (qad_main, ["--lr", "0"], "--lr: must be a number > 0"),
    (stages_main, ["boost", "--steps", "0"], "--steps: must be an integer >= 1, got 0"),
    (stages_main, ["eval", "--eval-prompts", "0"], "--eval-prompts: must be an integer >= 1, got 0"),
    (stages_main, ["hsm", "--seeds", "0"], "--seeds: must be an integer >= 1, got 0"),
    (report_main, ["--prompts", "0"], "--prompts: must be an integer >= 1, got 0"),
    (report_main, ["--bits", "-6"], "--bits: must be a number > 0"),
]


@pytest.mark.parametrize("main, argv, words", REFUSED_AT_PARSING,
                         ids=[f"{m.__name__}{' '.join(a)}" for m, a, _ in REFUSED_AT_PARSING])
def test_bad_settings_are_refused_while_parsing(main, argv, words, cache, capsys):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2
    assert words in capsys.readouterr().err
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".npy")) == []  # nothing written


def test_init_from_must_be_a_drafter_folder(cache, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--init-from {tmp_path / 'nowhere'}: no saved drafter there"):
        dflash_main(["--init-from", str(tmp_path / "nowhere"), "--steps", "1"])
    with pytest.raises(ValueError, match="bolt-mini is a target model .*, not a DFlash drafter"):
        dflash_main(["--init-from", str(CHECKPOINTS / "bolt-mini"), "--steps", "1"])


def test_mtp_stages_name_a_missing_input_folder(cache, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--post {tmp_path}: no model there"):
        stages_main(["boost", "--post", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="no pretrained lightning-mini in .*targets.train lightning-mini"):
        stages_main(["sft"])  # by default stage 1 reads the cache, where targets.train saves: empty here


def test_target_training_saves_into_the_user_cache_by_default(cache, capsys):
    targets_main([*TINY_TARGET, "--steps", "2"])
    out = cache / "models" / "bolt-nano"
    assert f"saved {out}" in capsys.readouterr().out
    record = json.loads((out / "training.json").read_text())
    assert record["settings"]["steps"] == 2 and record["model"] == "bolt-nano"
    sums = dict(line.split()[::-1] for line in (out / "SHA256SUMS").read_text().splitlines())
    assert sums["training.json"] == hashlib.sha256((out / "training.json").read_bytes()).hexdigest()
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(sums)
    assert (cache / "train" / "bolt-nano" / "train_state.pt").exists()
    import minispec as ms

    ms.load_target(out)  # the folder the last line names loads like a shipped model


def test_a_run_that_fails_while_saving_leaves_the_old_folder_intact(cache, tmp_path, monkeypatch):
    """The weights are written, then the tokenizer's save fails (before training.json): the old folder
    stays as it was, beside no leftover temporary folder; a good rerun then replaces it as a whole."""
    from transformers import AutoTokenizer

    out = tmp_path / "bolt-nano"
    shutil.copytree(CHECKPOINTS / "bolt-nano", out)
    before = tree_hashes(out)
    tokenizer_class = type(AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer"))

    def fail(self, folder, *args, **kwargs):
        assert (folder / "model.safetensors").exists()  # the new weights are already written
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer_class, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        targets_main([*TINY_TARGET, "--steps", "1", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    assert tree_hashes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bolt-nano", "cache", "work"]
    monkeypatch.undo()
    monkeypatch.setenv("MINISPEC_CACHE", str(cache))
    targets_main([*TINY_TARGET, "--steps", "1", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    assert json.loads((out / "training.json").read_text())["settings"]["steps"] == 1
    assert not (out / "eval.json").exists()  # the old model's record went with it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bolt-nano", "cache", "work"]


def test_save_atomically(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "old.txt").write_text("old")

    def half_written(tmp):
        (tmp / "weights.bin").write_bytes(b"new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        training.save_atomically(folder, half_written)
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and [p.name for p in folder.iterdir()] == ["old.txt"]
    training.save_atomically(folder, lambda tmp: (tmp / "sub").mkdir() or (tmp / "sub" / "b.txt").write_text("b"),
                             copy_of=folder)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == [
        "SHA256SUMS", "old.txt", "sub", "sub/SHA256SUMS", "sub/b.txt"]
    training.save_atomically(folder, lambda tmp: (tmp / "a.txt").write_text("a"))
    assert sorted(p.name for p in folder.iterdir()) == ["SHA256SUMS", "a.txt"]
    with pytest.raises(ValueError, match="is a file"):
        training.save_atomically(folder / "a.txt", lambda tmp: None)


DFLASH_TINY = ["--steps", "2", "--batch", "1", "--greedy-replies", "2", "--sampled-replies", "0", "--prompt-len",
               "8", "--reply-len", "12", "--num-anchors", "2", "--eval-replies", "1", "--warmup", "1"]


def test_dflash_resume_checks_init_from_and_lets_bookkeeping_change(cache, tmp_path):
    """A work dir of a run without --init-from, or from other init weights, is refused by name instead of
    silently resuming the old run; --ckpt-every and --eval-replies may change."""
    from minispec.dflash.model import DFlashDraftModel

    work = ["--work-dir", str(tmp_path / "work")]
    dflash_main([*DFLASH_TINY, *work])
    out = cache / "models" / "bolt-mini-dflash"
    assert json.loads((out / "training.json").read_text())["previous_stage"] is None
    start = tmp_path / "start"
    shutil.copytree(CHECKPOINTS / "bolt-mini-dflash", start)
    with pytest.raises(ValueError, match="other settings .*init_from: None there, .*start' in this run.*delete "
                                         "the work dir"):
        dflash_main([*DFLASH_TINY, *work, "--init-from", str(start)])
    dflash_main([*DFLASH_TINY, "--work-dir", str(tmp_path / "work2"), "--init-from", str(start)])
    assert json.loads((out / "training.json").read_text())["previous_stage"]["target"] == "bolt-mini"
    dflash_main([*DFLASH_TINY, "--work-dir", str(tmp_path / "work2"), "--init-from", str(start), "--ckpt-every", "5",
                 "--eval-replies", "2"])  # bookkeeping only: resumes (the run is complete) and saves again
    changed = DFlashDraftModel.from_pretrained(start)
    with torch.no_grad():
        next(changed.parameters()).add_(1.0)
    changed.save_pretrained(start)  # the same folder, other weights
    write_manifest(start)
    with pytest.raises(ValueError, match="other settings \\(init_weights: '[0-9a-f]+' there, '[0-9a-f]+' in this"):
        dflash_main([*DFLASH_TINY, "--work-dir", str(tmp_path / "work2"), "--init-from", str(start)])


@pytest.fixture
def tiny_target(tmp_path):
    model = tiny_gemma(layers=2, seed=5)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(5.0)
    return save_with_tokenizer(model, tmp_path / "tiny")


def test_qad_averages_the_steps_it_took_and_refuses_another_recipe_on_resume(cache, tiny_target, tmp_path):
    argv = ["--target", str(tiny_target), "--steps", "4", "--batch", "1", "--seq-len", "16", "--warmup", "1",
            "--work-dir", str(tmp_path / "work")]
    qad_main(argv)
    out = cache / "models" / "tiny-qad-aggressive"
    summary = json.loads((out / "summary.json").read_text())
    history = torch.load(tmp_path / "work" / "qad.pt", weights_only=False)["history"]
    assert len(history) == 4 and summary["train_kl_steps_averaged"] == 4
    assert summary["train_kl_first_20"] == pytest.approx(sum(history) / 4)  # not sum / 20
    assert summary["train_kl_last_20"] == pytest.approx(sum(history) / 4)
    assert set(torch.load(out / "student.pt")) and (out / "SHA256SUMS").exists()
    with pytest.raises(ValueError, match="other settings \\(recipe: .*'lightning-like'.* in this run\\)"):
        qad_main([*argv, "--recipe", "lightning-like"])
    qad_main([*argv, "--ckpt-every", "2"])  # bookkeeping only


def test_evalset_writes_into_the_user_cache_unless_told(cache, monkeypatch, tmp_path):
    from minispec.targets import evalset

    es = evalset.load_evalset()
    small = evalset.EvalSet(es.prompts[:3], es.continuations[:3], es.files[:3])
    monkeypatch.setattr(evalset, "build", lambda tok: (small, {"seed": 0}))
    evalset.main(["build"])
    assert len(evalset.load_evalset(cache / "evalset")) == 3
    monkeypatch.setattr(evalset, "score", lambda model, limit=None: {"loss": 1.0, "limit": limit})
    evalset.main(["score", "bolt-nano"])
    assert json.loads((cache / "models" / "bolt-nano" / "eval.json").read_text())["loss"] == 1.0
    copy = tmp_path / "bolt-nano"
    shutil.copytree(CHECKPOINTS / "bolt-nano", copy)
    evalset.main(["score", "bolt-nano", "--out", str(copy)])  # a model's folder keeps its other files
    assert {p.name for p in copy.iterdir()} == {p.name for p in (CHECKPOINTS / "bolt-nano").iterdir()} | {"SHA256SUMS"}
    assert json.loads((copy / "eval.json").read_text())["command"].endswith(f"--out {copy}")


def test_tokenizing_the_corpus_warns_about_nothing(tmp_path, monkeypatch):
    """A file longer than the tokenizer's model_max_length is tokenized whole and cut into windows later: no
    "sequence length is longer than the specified maximum" warning, which a notebook shows on stderr."""
    import logging

    from transformers import AutoTokenizer

    from minispec.targets.load import CHECKPOINTS

    tok = AutoTokenizer.from_pretrained(CHECKPOINTS / "tokenizer")
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    long_text = "def f(x):\n    return x + 1\n" * tok.model_max_length
    monkeypatch.setattr(data.corpus, "iter_files", lambda split: [type("F", (), {"text": long_text})()])
    monkeypatch.setattr(data.corpus, "data_hash", lambda files: "0" * 16)
    records, handler, logger = [], logging.Handler(), logging.getLogger("transformers")
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        stream = data.token_stream("val", tok)
    finally:
        logger.removeHandler(handler)
    assert len(stream) > tok.model_max_length
    assert not [r for r in records if "longer than the specified maximum" in r.getMessage()]
