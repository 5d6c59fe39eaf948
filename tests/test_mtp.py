"""minispec.mtp: the recursive MTP head as a drafter (exactness, its cache, weight names, bad input)."""
import pytest
import torch
from transformers import NemotronHConfig

import minispec as ms
from minispec.mtp import Backbone, MTPConfig, MTPDrafter, MTPHead
from minispec.mtp.boost import boost_loss, run_depths
from minispec.speculative.drafter import Sampling
from minispec.ssm.hybrid import HybridLM
from tiny import assert_same_as_ar, tiny_gemma

PROMPTS = [torch.tensor([5, 6, 7, 8, 9, 10]), torch.tensor([11, 12, 13])]  # ragged: left padding


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma(layers=2)


def random_head(backbone_model, seed=0, **kw):
    torch.manual_seed(seed)
    return MTPHead(MTPConfig.like(backbone_model.config, intermediate_size=128, **kw)).eval()


def tiny_hybrid(seed=0):
    torch.manual_seed(seed)
    cfg = NemotronHConfig(vocab_size=512, hidden_size=64, hybrid_override_pattern="M*-", num_attention_heads=2,
                          num_key_value_heads=1, head_dim=32, intermediate_size=128, mamba_num_heads=4,
                          mamba_head_dim=16, ssm_state_size=16, n_groups=1, conv_kernel=4, chunk_size=16,
                          tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return HybridLM(cfg).eval()


@pytest.fixture(scope="module")
def trained(gemma):
    """A head boosted for a few steps on the backbone's own greedy continuations, so it gets drafts accepted."""
    for p in gemma.parameters():
        p.requires_grad_(False)
    head = random_head(gemma).train()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 4096, (8, 3), generator=g)
    data = torch.cat([prompts, ms.autoregressive_generate(gemma, prompts, 17).tokens], dim=1)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    backbone = Backbone.of(gemma)
    history = []
    for _ in range(25):
        res = boost_loss(head, backbone, data, depths=2)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        history.append(res)
    return head.eval(), prompts, history


def test_weight_names_are_nemotron_mtp_names(gemma):
    names = list(random_head(gemma).state_dict(prefix="mtp."))
    assert names == ["mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
                     "mtp.layers.0.norm.weight", "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.0.mixer.k_proj.weight",
                     "mtp.layers.0.mixer.v_proj.weight", "mtp.layers.0.mixer.o_proj.weight",
                     "mtp.layers.1.norm.weight", "mtp.layers.1.mixer.up_proj.weight",
                     "mtp.layers.1.mixer.down_proj.weight", "mtp.layers.1.final_layernorm.weight"]
    assert random_head(gemma).layers[0].eh_proj.weight.shape == (64, 128)  # 2H -> H, no bias


def test_save_and_load_round_trip(gemma, tmp_path):
    head = random_head(gemma, seed=3)
    loaded = MTPHead.from_pretrained(head.save_pretrained(tmp_path / "mtp"))
    assert loaded.config == head.config
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_backbone_logits_are_the_targets_own(gemma):
    backbone = Backbone.of(gemma)
    ids = torch.tensor([[5, 6, 7, 8]])
    logits, hidden = backbone.run(ids)
    torch.testing.assert_close(backbone.logits(hidden), logits, atol=1e-5, rtol=1e-5)  # incl. Gemma's soft-cap
    torch.testing.assert_close(logits, gemma(ids).logits.float(), atol=1e-5, rtol=1e-5)


def test_hybrid_backbones_minispec_and_transformers(gemma):
    from transformers import NemotronHForCausalLM

    ours = tiny_hybrid()
    theirs = NemotronHForCausalLM(ours.config).eval()
    theirs.load_state_dict(ours.state_dict())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    (ours_logits, ours_hidden), (hf_logits, hf_hidden) = Backbone.of(ours).run(ids), Backbone.of(theirs).run(ids)
    torch.testing.assert_close(ours_hidden, hf_hidden, atol=1e-4, rtol=1e-4)  # both: after the final norm
    torch.testing.assert_close(Backbone.of(ours).logits(ours_hidden), ours_logits)
    torch.testing.assert_close(Backbone.of(theirs).logits(hf_hidden), hf_logits)


def test_greedy_equals_autoregressive_with_a_random_head(gemma):
    assert_same_as_ar(gemma, MTPDrafter(random_head(gemma), gemma, num_draft_tokens=3), PROMPTS, 20)


def test_boosting_lowers_kl_and_the_trained_head_is_exact_and_accepted(gemma, trained):
    head, prompts, history = trained
    first, last = history[0], history[-1]
    assert (last.kl < 0.7 * first.kl).all(), (first.kl, last.kl)
    assert (last.acceptance > first.acceptance).all()
    res = assert_same_as_ar(gemma, MTPDrafter(head, gemma, num_draft_tokens=3), list(prompts[:4]), 16)
    assert res.stats.tau > 1.3  # drafts are accepted, so commit's ragged multi-token path ran


class Recording(MTPDrafter):
    """An MTPDrafter that remembers every token it committed, row by row."""

    def begin(self, batch, target_out):
        super().begin(batch, target_out)
        self.seen = [batch.input_ids[b][batch.attention_mask[b].bool()].tolist() for b in range(batch.size)]
        self.first = True

    def propose(self, last, k, sampling, generator=None):
        if self.first:
            for b, t in enumerate(last.tolist()):
                self.seen[b].append(t)
            self.first = False
        return super().propose(last, k, sampling, generator)

    def commit(self, accepted, tokens, target_out):
        super().commit(accepted, tokens, target_out)
        for b in range(len(accepted)):
            self.seen[b].extend(tokens[b, : int(accepted[b]) + 1].tolist())


@pytest.mark.parametrize("model_name", ["gemma", "hybrid"])
def test_cache_after_ragged_acceptance_equals_a_fresh_full_pass(model_name, gemma):
    """After sampled decoding (rows accept different numbers of drafts), the head's next depth-1
    distribution equals the one computed from scratch over the whole committed sequence."""
    model = gemma if model_name == "gemma" else tiny_hybrid()
    prompts = PROMPTS if model_name == "gemma" else PROMPTS[:1]  # HybridTarget runs one sequence
    drafter = Recording(random_head(model, seed=1), model, num_draft_tokens=3)
    out = ms.speculative_generate(model, drafter, prompts, 24, temperature=1.0,
                                  generator=torch.Generator().manual_seed(0))
    accepted = [c.accepted for c in out.stats.cycles if c.cycle > 0]
    assert max(accepted) >= 1 and len(set(accepted)) > 1  # ragged, multi-token commits happened
    q = drafter.propose(torch.tensor([s[-1] for s in drafter.seen]), 1, Sampling(temperature=1.0),
                        torch.Generator().manual_seed(0)).q[:, 0]
    backbone = Backbone.of(model)
    for b, seq in enumerate(drafter.seen):
        ids = torch.tensor([seq])  # slot len-2 pairs h of the second-newest token with the newest
        _, hidden = backbone.run(ids)
        logits = run_depths(drafter.head, backbone, hidden, ids, 1)[0]
        # log q: a random head's q is close to uniform, so probabilities alone would hide differences.
        torch.testing.assert_close(q[b].log(), torch.log_softmax(logits[0, len(seq) - 2], -1), atol=1e-4, rtol=0)


def test_hybrid_backbone_greedy_equals_plain_decoding():
    model = tiny_hybrid()
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    out = ms.speculative_generate(model, MTPDrafter(random_head(model), model, num_draft_tokens=2), prompt, 16)
    assert torch.equal(out.tokens, ms.autoregressive_generate(model, prompt, 16).tokens)


def test_sampled_drafts_carry_q_and_argmax_drafts_do_not(gemma):
    head = random_head(gemma)
    out = ms.speculative_generate(gemma, MTPDrafter(head, gemma, 2), PROMPTS, 6, temperature=1.0,
                                  generator=torch.Generator().manual_seed(0))
    assert all(t.q < 1.0 for c in out.stats.cycles if c.cycle > 0 for t in c.tokens[:c.proposed])
    out = ms.speculative_generate(gemma, MTPDrafter(head, gemma, 2, argmax_drafts=True), PROMPTS, 6, temperature=1.0,
                                  generator=torch.Generator().manual_seed(0))
    assert all(t.q == 1.0 for c in out.stats.cycles if c.cycle > 0 for t in c.tokens[:c.proposed])


def test_bad_input_is_a_clear_error(gemma):
    with pytest.raises(ValueError, match="hidden size 96 != backbone hidden size 64"):
        MTPDrafter(random_head(gemma, hidden_size=96), gemma)
    with pytest.raises(ValueError, match="vocab size 1000 != backbone vocab size 4096"):
        MTPDrafter(random_head(gemma, vocab_size=1000), gemma)
    with pytest.raises(ValueError, match="head is torch.bfloat16 but the backbone is torch.float32"):
        MTPDrafter(random_head(gemma).to(torch.bfloat16), gemma)
    for k in (0, -2, 1.5):
        with pytest.raises(ValueError, match="K >= 1"):
            MTPDrafter(random_head(gemma), gemma, num_draft_tokens=k)
    drafter = MTPDrafter(random_head(gemma), gemma)
    with pytest.raises(ValueError, match="K >= 1"):
        drafter.propose(torch.tensor([5]), 0, Sampling())
    with pytest.raises(ValueError, match="pattern"):
        MTPConfig(hidden_size=64, vocab_size=4096, pattern="*M")
    with pytest.raises(ValueError, match="not a backbone"):
        Backbone.of(torch.nn.Linear(3, 3))


def test_bench_rows_on_a_tiny_hybrid():
    from minispec.bench.mtp import speed_rows

    model = tiny_hybrid()
    rows = speed_rows(model, random_head(model), [torch.tensor([5, 6, 7]), torch.tensor([8, 9])], 6, ks=(2,),
                      temperatures=(0.0, 1.0))
    assert [r["method"] for r in rows] == ["autoregressive", "MTP speculative", "MTP speculative"]
    assert rows[1]["equal_to_ar"] is True and rows[1]["tau"] >= 1.0 and len(rows[1]["per_position"].split()) == 2


def test_bench_training_step_rows_time_every_context_and_leave_the_head_as_it_was():
    from minispec.bench.mtp import training_step_rows

    model = tiny_hybrid()
    head = random_head(model)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    rows = training_step_rows(model, head, torch.randint(3, 512, (2, 10)), depths=2, repeats=1)
    assert [r["boosting step"] for r in rows] == ["unrolled", "hsm", "stitched"]
    assert rows[0]["vs_unrolled"] == 1.0 and all(r["ms_per_step"] > 0 for r in rows)
    assert all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())


def test_attention_plus_moe_block_as_nemotron_3_5():
    model = tiny_hybrid()
    head = random_head(model, pattern="*E", moe_intermediate_size=64, moe_shared_expert_intermediate_size=64)
    assert [k for k in head.state_dict(prefix="mtp.") if ".layers.1." in k] == [
        "mtp.layers.1.norm.weight", "mtp.layers.1.mixer.gate.weight", "mtp.layers.1.mixer.gate.e_score_correction_bias",
        "mtp.layers.1.mixer.experts.up_proj", "mtp.layers.1.mixer.experts.down_proj",
        "mtp.layers.1.mixer.shared_experts.up_proj.weight", "mtp.layers.1.mixer.shared_experts.down_proj.weight",
        "mtp.layers.1.final_layernorm.weight"]
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    out = ms.speculative_generate(model, MTPDrafter(head, model, num_draft_tokens=2), prompt, 12)
    assert torch.equal(out.tokens, ms.autoregressive_generate(model, prompt, 12).tokens)
    boost_loss(head, Backbone.of(model), torch.randint(3, 512, (2, 10)), depths=2).loss.backward()
    assert head.layers[1].mixer.experts.up_proj.grad.abs().sum() > 0  # experts start non-zero, so they train


def test_load_drafter_mtp_reads_the_head_beside_the_target(gemma, tmp_path):
    """`ms.load_drafter("mtp", target)` finds mtp_config.json + mtp.safetensors in the target's own folder
    (vLLM's `method: "mtp"`), with the head's weights exactly as saved; a target without one is refused."""
    model = tiny_hybrid()
    folder = tmp_path / "hybrid"
    model.config.save_pretrained(folder)
    model.config.name_or_path = str(folder)
    head = random_head(model, seed=3)
    head.save_pretrained(folder)
    drafter = ms.load_drafter("mtp", model, num_draft_tokens=2)
    assert isinstance(drafter, MTPDrafter) and drafter.num_draft_tokens == 2
    assert all(torch.equal(a, b) for a, b in zip(drafter.head.state_dict().values(), head.state_dict().values()))
    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    out = ms.speculative_generate(model, drafter, prompt, 12)
    assert torch.equal(out.tokens, ms.autoregressive_generate(model, prompt, 12).tokens)
    with pytest.raises(ValueError, match="no MTP head beside its weights"):
        ms.load_drafter("mtp", gemma)


@pytest.mark.slow
def test_load_drafter_mtp_on_the_shipped_lightning_mini():
    from minispec.targets.load import resolve

    model = HybridLM.from_pretrained("lightning-mini")
    drafter = ms.load_drafter("mtp", model)
    shipped = MTPHead.from_pretrained(resolve("lightning-mini"))
    assert drafter.num_draft_tokens == 3
    assert all(torch.equal(a, b) for a, b in zip(drafter.head.state_dict().values(), shipped.state_dict().values()))
