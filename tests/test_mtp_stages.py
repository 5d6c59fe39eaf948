"""minispec.mtp.stages: a HybridLM's replies (minispec.targets.replies), the stage-1 loop resumes exactly,
and the shipped heads (stage 1 beside lightning-mini, boosted beside lightning-mini-post) are exact and help."""
import json
from dataclasses import replace

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

import minispec as ms
from minispec.mtp import MTPDrafter, MTPHead, check_head_fits, stages
from minispec.mtp.backbone import Backbone
from minispec.results import load_result
from minispec.ssm.hybrid import HybridLM
from minispec.targets.replies import replies_to


def tiny_hybrid(vocab=4096, seed=0):
    torch.manual_seed(seed)
    cfg = NemotronHConfig(vocab_size=vocab, hidden_size=32, hybrid_override_pattern="M*E", num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=48, mamba_num_heads=4,
                          mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8, n_routed_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
                          pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = HybridLM.from_hf(NemotronHForCausalLM(cfg).eval())
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def test_greedy_replies_are_the_models_own_greedy_continuation():
    model = tiny_hybrid(vocab=64)
    prompts = torch.randint(3, 64, (5, 9), generator=torch.Generator().manual_seed(0))
    replies = replies_to(model, prompts, 7, temperature=0.0, batch_size=2)
    assert replies.input_ids.shape == (5, 16)
    assert torch.equal(replies.input_ids[:, :9], prompts)
    reply = replies.input_ids[:, 9:]
    mask = replies.loss_mask[:, 9:].bool()
    assert not replies.loss_mask[:, :9].any()
    for row in range(5):
        expected = ms.autoregressive_generate(model, prompts[row: row + 1], 7).tokens[0]
        n = int(mask[row].sum())
        assert torch.equal(reply[row, :n], expected[:n])
        eos = (expected == 1).nonzero()
        assert n == (7 if len(eos) == 0 else int(eos[0]) + 1)  # counted up to and including an EOS


def test_sampled_replies_are_seeded():
    model = tiny_hybrid(vocab=64)
    prompts = torch.randint(3, 64, (3, 6), generator=torch.Generator().manual_seed(1))
    a = replies_to(model, prompts, 5, temperature=1.0, seed=3)
    b = replies_to(model, prompts, 5, temperature=1.0, seed=3)
    c = replies_to(model, prompts, 5, temperature=1.0, seed=4)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    with pytest.raises(ValueError, match="reply_len"):
        replies_to(model, prompts, 0)


def tiny_hf(seed=0):
    torch.manual_seed(seed)
    return NemotronHForCausalLM(NemotronHConfig(
        vocab_size=4096, hidden_size=32, hybrid_override_pattern="M*E", num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
        chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, pad_token_id=0, eos_token_id=1, bos_token_id=2))


def test_stage1_trains_backbone_and_head_together_and_resumes_exactly(tmp_path):
    s = stages.SFTSettings(steps=3, batch=2, seq_len=12, depths=2, warmup=1, ckpt_every=1)
    start = tiny_hf()
    straight_model = tiny_hf()
    straight, h1 = stages.train_sft(straight_model, s, tmp_path / "a")
    stages.train_sft(tiny_hf(), s, tmp_path / "b", stop_after=2)
    resumed_model = tiny_hf()
    resumed, h2 = stages.train_sft(resumed_model, s, tmp_path / "b")
    assert h1 == h2 and len(h1) == 3
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for (name, a), b in zip(straight_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name
    moved = [n for n, p in straight_model.named_parameters() if not torch.equal(p, start.state_dict()[n])]
    assert "lm_head.weight" in moved and any(".mixer." in n for n in moved)  # the backbone trained too
    assert all(h["lm"] < 9.0 and h["ce"][0] < 9.0 for h in h1)  # finite, near log(4096) = 8.3 at init
    with pytest.raises(ValueError, match="other settings"):
        stages.train_sft(tiny_hf(), stages.SFTSettings(steps=4, batch=2, seq_len=12, depths=2), tmp_path / "b")


def test_shipped_lightning_mini_is_the_joint_sft_stage_and_stage1_refuses_to_restart_from_it(tmp_path):
    record = json.loads((stages.SFT_FOLDER / "training.json").read_text())
    assert record["command"].startswith("python -m minispec.mtp.stages sft") and "joint" in record["stage"]
    assert record["previous_stage"]["command"].startswith("python -m minispec.targets.train lightning-mini")
    assert record["val_loss"] < record["previous_stage"]["val_loss"]  # same val windows
    with pytest.raises(ValueError, match="already holds the joint SFT stage.*targets.train lightning-mini"):
        stages.pretrained_backbone(stages.SFT_FOLDER)
    with pytest.raises(FileNotFoundError, match=f"no pretrained lightning-mini in {tmp_path}"):
        stages.pretrained_backbone(tmp_path)


@pytest.fixture(scope="module")
def shipped():
    sft, post = stages.load_backbone(stages.SFT_FOLDER), stages.load_backbone(stages.POST_FOLDER)
    return sft, post, MTPHead.from_pretrained(stages.SFT_FOLDER), MTPHead.from_pretrained(stages.POST_FOLDER)


def test_shipped_heads_are_mtp_named_fit_and_greedy_equals_ar(shipped):
    sft, post, stale, boosted = shipped
    from safetensors.torch import load_file

    names = load_file(stages.POST_FOLDER / "mtp.safetensors")
    assert all(k.startswith("mtp.layers.") for k in names) and "mtp.layers.0.eh_proj.weight" in names
    check_head_fits(stale, Backbone.of(sft))
    check_head_fits(boosted, Backbone.of(post))
    for name in stages.boost_runs():  # every stage-3 head ships (boost-hsm is `boosted`, beside its backbone)
        head = MTPHead.from_pretrained(stages.head_folder(name))
        check_head_fits(head, Backbone.of(post))
        record = json.loads((stages.head_folder(name) / "mtp_training.json").read_text())
        assert record["stage"].startswith(f"3: {name}")
    prompt = ms.load_evalset().prompts[0][None]
    for model, head in ((sft, stale), (post, boosted)):
        out = ms.speculative_generate(model, MTPDrafter(head, model, 3), prompt, 20)
        assert torch.equal(out.tokens[0], ms.autoregressive_generate(model, prompt, 20).tokens[0])


def test_post_training_moved_the_backbone_and_boosting_caught_up(shipped):
    sft, post, stale, boosted = shipped
    from minispec.mtp.boost import distribution_shift

    ids = torch.stack([p[:64] for p in ms.load_evalset().prompts[:8]])
    shift = distribution_shift(sft, post, ids)
    assert shift["kl"] > 0.05 and shift["one_minus_tv"] < 0.95
    prompts = ms.load_evalset().prompts[:4]
    modes = (("T=0", 0.0, False),)
    before = stages.acceptance(post, stale, prompts, 3, 16, modes=modes)["T=0"]["tau"]
    after = stages.acceptance(post, boosted, prompts, 3, 16, modes=modes)["T=0"]["tau"]
    assert after > before * 1.05, (before, after)


def test_hsm_study_pairs_seeds_and_resumes(tmp_path):
    model = tiny_hybrid()
    start = MTPHead(stages.head_config(model.config))
    prompts = torch.randint(3, 4096, (6, 8), generator=torch.Generator().manual_seed(2))
    replies = replies_to(model, prompts, 8, temperature=1.0)
    held_out = replies_to(model, prompts[:3], 8, temperature=1.0, seed=5)
    arms = {name: replace(s, steps=2, batch=2, warmup=1) for name, s in stages.hsm_arms().items()}
    assert {name: (s.depths, s.context) for name, s in arms.items()} == {
        "boost-depth1": (1, "unrolled"), "boost-nohsm": (3, "unrolled"), "boost-hsm": (3, "hsm"),
        "boost-ttt": (3, "stitched")}
    a = stages.hsm_study(model, start, replies, held_out, list(prompts[:2]), 2, arms, tmp_path, max_new_tokens=4)
    on, off = (torch.tensor([r["one_minus_tv"] for r in a["runs"][name]]) for name in ("boost-ttt", "boost-depth1"))
    assert on.shape == off.shape == (2, stages.SIGNAL_DEPTHS)
    assert ((on > 0) & (on < 1)).all() and not torch.equal(on[0], on[1])  # the seed changes the run
    assert set(a["runs"]["boost-hsm"][0]) == {"one_minus_tv", "AL K=3 T=0", "AL K=3 T=1", "AL K=7 T=0", "AL K=7 T=1"}
    pair = a["paired"]["boost-depth1 - boost-ttt"]["one_minus_tv"]
    torch.testing.assert_close(torch.tensor(pair["mean"]), (off - on).mean(0))
    torch.testing.assert_close(torch.tensor(pair["stderr"]), (off - on).std(0) / 2 ** 0.5)
    assert len(a["paired"]) == 6  # every pair of the four arms
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}-seed{i}" for n in arms for i in range(2))
    assert stages.hsm_study(model, start, replies, held_out, list(prompts[:2]), 2, arms, tmp_path, 4) == a  # resumed


def test_shipped_study_and_transfer_results_hold_what_the_docs_quote():
    study = load_result("mtp-hsm-study")
    assert list(study["runs"]) == list(stages.hsm_arms()) and study["command"].startswith(
        "python -m minispec.mtp.stages hsm")
    seeds = {len(runs) for runs in study["runs"].values()}
    assert len(seeds) == 1 and seeds.pop() >= 2
    transfer = load_result("mtp-transfer")
    assert transfer["command"].startswith("python -m minispec.mtp.stages transfer")
    assert transfer["paper"]["AL"] == [3.787, 4.436, 4.612]
    assert set(transfer["steps"]) == set(stages.transfer_runs())
    moved = transfer["rows"]["boosted on SFT, moved unchanged to post-trained"]
    stale = transfer["rows"]["stage-1 head on post-trained backbone"]
    assert set(moved) == set(stale) and len(moved["one_minus_tv"]) == stages.SIGNAL_DEPTHS


def test_shipped_heads_reproduce_their_recorded_signal(shipped):
    """docs/benchmarks.md and notebook 03 quote mtp_eval.json; the shipped heads must still give its numbers
    (held-out replies are resampled here, seeded, so a near-tie flipping a token may move them a little)."""
    post = shipped[1]
    held_out = stages.corpus_replies(post, num=64, seed=1)
    recorded = json.loads((stages.POST_FOLDER / "mtp_eval.json").read_text())["signal"]
    for name in stages.boost_runs():
        measured = stages.signal(post, MTPHead.from_pretrained(stages.head_folder(name)), held_out,
                                 context="unrolled")  # as mtp_eval.json recorded it
        expected = recorded[f"{name} on post-trained backbone"]
        torch.testing.assert_close(torch.tensor(measured["one_minus_tv"]), torch.tensor(expected["one_minus_tv"]),
                                   atol=5e-3, rtol=0)
