"""The stored taps (minispec.dflash.taps) and what trains from them: they are the live target's states, the
job resumes without recomputing a shard, distillation from the stored final states equals distillation from
the live target's logits, and `init_from_target` starts the drafter from the target's last layer."""
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minispec.dflash import data, mask, taps
from minispec.dflash.config import DFlashConfig
from minispec.dflash.model import DFlashDraftModel
from minispec.dflash.train import Settings, evaluate, init_from_target, step_loss, train
from minispec.training import weights_digest

LAYERS = [0, 2]


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(20.0)  # logits sharp enough to distil from
        model.model.norm.weight.fill_(1.8)
    return model


def new_drafter(target, seed=1, draft_vocab=None):
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(target.config, LAYERS, 3, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  block_size=4, draft_vocab_size=draft_vocab)
    return DFlashDraftModel.for_target(cfg, target)


def reply_set(folder, shards=2, samples=5, seed=0):
    """A reply set in the data job's format: random prompts and replies, every second reply at T = 1."""
    g = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("heldout", "train"):
        for i in range(shards):
            P, R = g.integers(3, 9, samples), g.integers(6, 20, samples)
            data.save_shard(folder / data.shard_name(split, i), {
                "tokens": g.integers(4, 512, int((P + R).sum())).astype(np.uint16),
                "prompt_lengths": P.astype(np.int32), "reply_lengths": R.astype(np.int32),
                "temperatures": np.array([0.0, 1.0] * samples, dtype=np.float32)[:samples],
                "keys": np.array([f"c{i}:{j}" for j in range(samples)])})
    return folder


def test_stored_taps_are_the_live_target_states_and_the_job_resumes(target, tmp_path, monkeypatch):
    replies, out = reply_set(tmp_path / "set"), tmp_path / "taps"
    taps.build(target, LAYERS, replies, out)
    made = []
    real = taps.shard_states
    monkeypatch.setattr(taps, "shard_states", lambda *a: made.append(a) or real(*a))
    taps.build(target, LAYERS, replies, out)
    assert made == []  # every shard is there: nothing is computed again
    (out / "train-00001.final.npy").unlink()
    taps.build(target, LAYERS, replies, out)
    assert len(made) == 1  # only the unfinished shard

    train_set = taps.TapSet(replies, out, "train")
    assert len(train_set) == 10
    batch = train_set.rows([0, 7])
    for b, i in enumerate([0, 7]):
        n = int(batch.input_ids[b].ne(0).sum())
        with torch.no_grad():
            live = target(input_ids=batch.input_ids[b: b + 1, :n], output_hidden_states=True)
        expected = torch.cat([live.hidden_states[k + 1] for k in LAYERS], -1)[0]
        torch.testing.assert_close(batch.features[b, :n].float(), expected, atol=0.02 * expected.abs().max(), rtol=0.01)
        logits = target.get_output_embeddings()(batch.final[b, :n].float())
        assert (logits.argmax(-1) == live.logits[0].argmax(-1)).float().mean() > 0.95  # bf16 states
        prompt = int(train_set.prompt[i // 5][i % 5])
        assert batch.loss_mask[b, :prompt].sum() == 0 and batch.loss_mask[b, prompt:n].all()
    assert train_set.reply_tokens == len(train_set.reply_token_ids())
    with pytest.raises(FileNotFoundError, match="python -m minispec.dflash.taps"):
        taps.TapSet(replies, tmp_path / "elsewhere", "train")


def test_a_later_stage_taps_and_reads_only_its_train_shards(target, tmp_path):
    replies, out = reply_set(tmp_path / "set", shards=4), tmp_path / "taps"
    taps.build(target, LAYERS, replies, out, train_shards=data.shard_slice("2:"))
    made = sorted(p.name.split(".")[0] for p in out.glob("*.final.npy"))
    assert made == [f"heldout-0000{i}" for i in range(4)] + ["train-00002", "train-00003"]  # held out: always all
    newest = taps.TapSet(replies, out, "train", data.shard_slice("2:"))
    assert len(newest) == 10 and newest.rows([0]).input_ids[0, 0] == int(data.read_shard(
        replies / "train-00002.npz")["tokens"][0])
    with pytest.raises(FileNotFoundError, match=r"train-00000.npz', 'train-00001.npz'\]"):
        taps.TapSet(replies, out, "train", data.shard_slice("3"))
    with pytest.raises(FileNotFoundError, match="no train shards 9:"):
        taps.TapSet(replies, out, "train", data.shard_slice("9:"))


@pytest.mark.parametrize("spec, expected", [("6", slice(None, 6)), ("59:", slice(59, None)), ("4:8", slice(4, 8)),
                                            (":3", slice(None, 3))])
def test_shard_ranges(spec, expected):
    assert data.shard_slice(spec) == expected


@pytest.mark.parametrize("spec, message", [("", "is N"), (":", "is N"), ("-1", "is N"), ("1:2:3", "is N"),
                                           ("0", "holds no shard"), ("5:5", "holds no shard"),
                                           ("9:3", "holds no shard")])
def test_a_bad_shard_range_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        data.shard_slice(spec)
    with pytest.raises(ValueError, match=message):
        Settings(train_shards=spec) if spec else data.shard_slice(spec)


def test_distillation_from_stored_final_states_equals_the_live_target(target, tmp_path):
    replies, out = reply_set(tmp_path / "set"), tmp_path / "taps"
    taps.build(target, LAYERS, replies, out)
    b = taps.TapSet(replies, out, "train").rows([1, 2, 3])
    drafter = new_drafter(target)
    s = Settings(batch=3, num_anchors=4, distill=1.0, greedy_replies=1, sampled_replies=0)
    stored, _ = step_loss(drafter, target, b.input_ids, b.loss_mask, s, 0, b.features, final=b.final)
    live, _ = step_loss(drafter, target, b.input_ids, b.loss_mask, s, 0)  # the target runs over the batch
    assert abs(float(stored) - float(live)) < 0.01 * float(live)
    hard, _ = step_loss(drafter, target, b.input_ids, b.loss_mask, Settings(batch=3, num_anchors=4, distill=0.0),
                        0, b.features, final=b.final)
    assert abs(float(hard) - float(stored)) > 0.05  # the soft loss is another loss, not the hard one

    small = new_drafter(target, draft_vocab=64)
    small.set_draft_vocab(torch.arange(4, 68))
    loss, _ = step_loss(small, target, b.input_ids, b.loss_mask, s, 0, b.features, final=b.final)
    assert torch.isfinite(loss)  # over a reduced vocabulary too, where a live target's logits do not fit


def test_init_from_target_copies_the_last_layer_and_norm_and_scales_fc(target, tmp_path):
    drafter = new_drafter(target)
    fc = drafter.fc.weight.clone()
    rms = torch.rand(len(LAYERS) * 64) + 0.5
    copied = init_from_target(drafter, target, rms)
    last = target.model.layers[-1]
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, last.self_attn.q_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    assert "layers.0.self_attn.q_norm.weight" not in copied  # a Llama layer has none: it stays at ones
    torch.testing.assert_close(drafter.fc.weight * rms / rms.mean(), fc)
    from tiny import tiny_gemma
    with pytest.raises(ValueError, match="'gemma4_text'"):
        init_from_target(new_drafter(target), tiny_gemma(), rms)


def test_training_from_stored_taps_learns_resumes_and_measures_tau(target, tmp_path):
    replies, out = reply_set(tmp_path / "set", samples=8), tmp_path / "taps"
    taps.build(target, LAYERS, replies, out)
    train_set, heldout = taps.TapSet(replies, out, "train"), taps.TapSet(replies, out, "heldout")
    s = Settings(steps=8, batch=4, num_anchors=6, lr=1e-2, warmup=1, ckpt_every=4, distill=0.5, eval_replies=16,
                 greedy_replies=1, sampled_replies=0)
    whole = new_drafter(target)
    history = train(whole, target, train_set, s, tmp_path / "whole")
    assert history[-1]["loss"] < history[0]["loss"]
    first = history[0]["loss"]
    parts = new_drafter(target)
    train(parts, target, train_set, s, tmp_path / "parts", stop_after=4)
    train(parts, target, train_set, s, tmp_path / "parts")
    assert weights_digest(parts) == weights_digest(whole)
    metrics = evaluate(whole, target, heldout, s)
    assert 1.0 <= metrics["tau"] <= 4.0 and 0 <= metrics["accuracy"] <= 1

    mixed = new_drafter(target)  # bfloat16 matmuls: another path, still learning and still resumable
    history = train(mixed, target, train_set, replace(s, mixed_precision=True), tmp_path / "mixed")
    assert history[-1]["loss"] < history[0]["loss"] and abs(history[0]["loss"] - first) < 0.05 * first


def test_acceptance_length_counts_the_leading_hits_of_each_block():
    labels = torch.tensor([[[5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 3]]])  # [1, N = 3, T = 4]
    drafts = torch.tensor([[[0, 1, 2, 0], [0, 0, 2, 3], [0, 1, 2, 3]]])
    logits = torch.nn.functional.one_hot(drafts, 8).float()
    weights = torch.tensor([[[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 0]]]).float()  # block 2 ends at k = 2
    tau, n = mask.acceptance_length(logits, labels, weights, torch.tensor([[True, True, True]]))
    assert n == 3 and tau == pytest.approx((3 + 1 + 3) / 3)
    tau, n = mask.acceptance_length(logits, labels, weights, torch.tensor([[True, False, False]]))
    assert n == 1 and tau == 3


def test_the_walk_visits_the_positions_the_loop_would():
    # Four misses, then a stretch the drafter knows: the loop spends a cycle per miss and one on the stretch,
    # so its tokens per cycle (12 / 5) sit below the mean over uniform anchors (40 / 12).
    runs = [0, 0, 0, 0, 7, 6, 5, 4, 3, 2, 1, 0]
    assert mask.walk(runs) == [0, 1, 2, 3, 4]  # tau 12 / 5
    assert sum(1 + r for r in runs) / len(runs) == pytest.approx(40 / 12)
    assert mask.walk([3, 0, 0, 0, 1, 0]) == [0, 4]  # the second cycle reaches the end
    assert mask.walk([5]) == [0] and mask.walk([]) == []


def test_compare_sets_runs_side_by_side_and_refuses_records_without_tau(tmp_path):
    import json

    from minispec.dflash import compare
    from minispec.lessons.dflash import training_story

    def record(folder, tau, cpu, **settings):
        folder.mkdir()
        s = {"init_from_target": False, "distill": 0.0, "num_layers": 0, "block_size": 0, "num_anchors": 32,
             "steps": 100, "train_shards": "6"} | settings
        (folder / "training.json").write_text(json.dumps({
            "settings": s, "parameters": 5, "loss_history_every_10": [70.0, 9.0], "final_train_loss_avg100": 6.0,
            "val_loss": 6.5, "val_weighted_accuracy": 0.1, "val_tau_greedy_blocks": tau, "cpu_seconds": cpu,
            "command": "python -m minispec.dflash.train"}))
        return folder

    runs = [record(tmp_path / "random", 1.1, 1800), record(tmp_path / "init", 1.3, 1800, init_from_target=True)]
    curve = json.loads((runs[1] / "training.json").read_text()) | {"val_history": [
        {"step": 50, "val_tau": 1.05, "cpu_seconds": 900.0}, {"step": 100, "val_tau": 1.3, "cpu_seconds": 1800.0}]}
    (runs[1] / "training.json").write_text(json.dumps(curve))
    compare.main([*map(str, runs), "--out", str(tmp_path / "c.json")])
    result = json.loads((tmp_path / "c.json").read_text())
    assert [r["run"] for r in result["rows"]] == ["random", "init"]
    assert result["rows"][1]["tau_gain_per_cpu_hour"] == pytest.approx(0.6)  # (1.3 - 1) / 0.5 h
    assert result["rows"][0]["tap_layers"] == ""  # a run made before the setting existed: the default taps
    assert result["rows"][0]["first_loss"] == 70.0 and result["command"].startswith("python -m minispec.dflash.compare")
    assert result["rows"][1]["curve"] == [[0.25, 1.05], [0.5, 1.3]] and result["rows"][0]["curve"] == []
    story = training_story(result, shipped="init")
    assert len(story.axes[0].lines) == 4  # two runs, one curve, the tau = 1 line
    assert [t.get_text() for t in story.axes[1].get_legend().get_texts()] == ["random"]  # the pairs, without the star

    second = json.loads((runs[1] / "training.json").read_text()) | {
        "val_tau_greedy_blocks": 1.5, "cpu_seconds": 3600, "loss_history_every_10": [6.4],
        "command": "python -m minispec.dflash.train --init-from init", "val_history": [
            {"step": 200, "val_tau": 1.5, "cpu_seconds": 3600.0}]}
    second["previous_stage"] = json.loads((runs[1] / "training.json").read_text())
    (tmp_path / "stage2").mkdir()
    (tmp_path / "stage2" / "training.json").write_text(json.dumps(second))
    row = compare.run_row(tmp_path / "stage2")  # a second stage counts from the first stage's random start
    assert (row["stages"], row["steps"], row["cpu_hours"], row["first_loss"]) == (2, 200, 1.5, 70.0)
    assert row["curve"] == [[0.25, 1.05], [0.5, 1.3], [1.5, 1.5]]
    assert row["tau_gain_per_cpu_hour"] == pytest.approx(0.5 / 1.5, abs=1e-3)
    assert row["command"] == "python -m minispec.dflash.train && python -m minispec.dflash.train --init-from init"

    compare.main([str(tmp_path / "stage2"), "--keep", str(tmp_path / "c.json"), "--out", str(tmp_path / "d.json")])
    again = json.loads((tmp_path / "d.json").read_text())["rows"]
    assert [r["run"] for r in again] == ["random", "init", "stage2"] and again[:2] == result["rows"]
    (tmp_path / "init" / "training.json").write_text(json.dumps(second))  # "init" retrained: its row is replaced
    compare.main([str(tmp_path / "init"), "--keep", str(tmp_path / "d.json"), "--out", str(tmp_path / "e.json")])
    again = json.loads((tmp_path / "e.json").read_text())["rows"]
    assert [r["run"] for r in again] == ["random", "init", "stage2"] and again[1]["val_tau"] == 1.5

    old = tmp_path / "old"
    old.mkdir()
    (old / "training.json").write_text(json.dumps({"val_tau_greedy_blocks": None, "cpu_seconds": None}))
    with pytest.raises(ValueError, match="no held-out tau"):
        compare.run_row(old)
    with pytest.raises(FileNotFoundError, match="training.json"):
        compare.run_row(tmp_path / "nowhere")


def test_tap_layers_setting_names_the_tapped_layers_or_refuses():
    assert Settings(tap_layers="1,14,27").tap_layer_ids == [1, 14, 27]
    assert Settings().tap_layer_ids == []  # the drafter config's own taps
    for bad in ("1;14", "1,,14", "a,b", "-1,3"):
        with pytest.raises(ValueError, match="comma-separated list of layer numbers"):
            Settings(tap_layers=bad)
