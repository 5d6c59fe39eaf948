"""minispec.costs section 7 (serving): the roofline by batch, break-even batches, memory per request, and the
numbers notebook 06 shows (minispec.lessons.serving_costs)."""
import pytest

from minispec import costs
from minispec.costs import GB, MiB


def test_accelerators_as_their_datasheets_give_them():
    assert (costs.H200.memory_bytes, costs.H200.bandwidth, costs.H200.flops) == (141e9, 4.8e12, 989e12)
    assert (costs.B200.memory_bytes, costs.B200.bandwidth) == (180e9, 8e12)


def test_e4b_kv_cache_per_request():
    # E4B has 7 full-attention and 35 sliding layers, but its last 18 reuse earlier layers' K and V (Gemma 4 E4B's
    # num_kv_shared_layers: 18), so 24 keep a cache: 4 full (2 KV heads of 512) grow with the context, 20 sliding
    # (2 of 256) keep 512 tokens.
    e4b = costs.E4B_TARGET
    assert e4b.kv_bytes(2048) == 4 * 2048 * 2 * 2 * 512 * 2 + 20 * 512 * 2 * 2 * 256 * 2 == 52 * MiB
    assert e4b.kv_bytes(100) == 100 * (4 * 4096 + 20 * 2048)


def test_the_drafter_cache_is_20_mib_per_request_and_1_25_gib_at_64():
    drafter = costs.e4b_dflash_drafter()
    assert drafter.kv_bytes(4096) == 20 * MiB
    assert 64 * drafter.kv_bytes(4096) == 1.25 * 2**30
    with_drafter = costs.memory_per_request(costs.E4B_TARGET, 2048, drafter)
    assert with_drafter - costs.memory_per_request(costs.E4B_TARGET, 2048) == 20 * MiB
    assert drafter.weight_bytes == costs.nvfp4_bytes(1_031_568_640)


def test_weights_are_read_once_per_forward():
    e4b = costs.E4B_TARGET
    one = costs.forward_seconds(e4b, costs.H200, 1, 1, 0)
    assert one == pytest.approx(3.8e9 * 2 / 4.8e12)  # memory-bound: the active weights, once
    assert costs.forward_seconds(e4b, costs.H200, 1, 8, 0) == one  # verifying 8 tokens costs the same at batch 1
    big = 4096
    assert costs.forward_seconds(e4b, costs.H200, big, 8, 0) == pytest.approx(
        8 * costs.forward_seconds(e4b, costs.H200, big, 1, 0))  # compute-bound: K + 1 times a decode step


def test_mixture_of_experts_reads_more_experts_with_more_tokens():
    sup = costs.super_target()
    assert sup.weight_bytes == pytest.approx(120e9 * 4.82 / 8)
    assert sup.weight_bytes_read(1) == pytest.approx(sup.active_weight_bytes)
    assert sup.weight_bytes_read(4) == pytest.approx(sup.weight_bytes * (1 - 0.9**4))
    assert sup.weight_bytes_read(10_000) == pytest.approx(sup.weight_bytes)
    assert costs.E4B_TARGET.weight_bytes_read(64) == costs.E4B_TARGET.active_weight_bytes


def test_e4b_speedup_falls_with_the_batch_and_stops_paying():
    drafting = costs.Drafting(tau=4.01, num_drafts=7, drafter=costs.e4b_dflash_drafter(), tokens_per_pass=8)
    gains = [costs.speedup_at_batch(costs.E4B_TARGET, costs.H200, b, drafting, 2048) for b in (1, 8, 64, 512)]
    assert gains == sorted(gains, reverse=True)
    assert 3.5 < gains[0] < 4.01 and gains[-1] < 1
    b = costs.break_even_batch(costs.E4B_TARGET, costs.H200, drafting, 2048)
    assert costs.speedup_at_batch(costs.E4B_TARGET, costs.H200, b - 1, drafting, 2048) > 1
    assert costs.speedup_at_batch(costs.E4B_TARGET, costs.H200, b, drafting, 2048) <= 1
    assert b < costs.break_even_batch(costs.E4B_TARGET, costs.B200, drafting, 2048)  # B200: more FLOPs per byte


def test_break_even_edge_cases():
    free = costs.Drafting(tau=2.0, num_drafts=1)  # one free draft, tau 2: pays until verify costs 2 steps
    assert costs.break_even_batch(costs.E4B_TARGET, costs.H200, free, 0, max_batch=8) is None
    hopeless = costs.Drafting(tau=1.0, num_drafts=3, draft_ratio=0.5)
    assert costs.break_even_batch(costs.E4B_TARGET, costs.H200, hopeless) == 1


def test_mamba_memory_per_request_with_and_without_replay():
    shape = costs.SUPER_MAMBA2
    state = costs.mamba_state_bytes(shape) + 3 * (128 * 64 + 2 * 8 * 128) * 2  # SSM state + conv window
    assert costs.SUPER_MAMBA_LAYERS == 40
    assert costs.mamba_request_bytes(shape, 40) == 40 * state
    assert costs.mamba_request_bytes(shape, 40, 4) == 40 * 4 * state
    record = (128 * 64 + 8 * 128) * 2 + 128 * 4 + (128 * 64 + 2 * 8 * 128) * 2
    assert costs.mamba_request_bytes(shape, 40, 4, "replay") == 40 * (state + 16 * record)
    native = costs.memory_per_request(costs.super_target(), 2048, spec_window=4)
    replay = costs.memory_per_request(costs.super_target("replay"), 2048, spec_window=4)
    assert 3 < native / replay < 4


def test_requests_that_fit():
    assert costs.requests_that_fit(costs.H200, 10 * GB, 1 * GB) == 116  # 0.9 * 141 - 10 = 116.9
    assert costs.requests_that_fit(costs.H200, 200 * GB, 1 * GB) == 0
    with pytest.raises(ValueError, match="utilization"):
        costs.requests_that_fit(costs.H200, 10 * GB, 1 * GB, utilization=1.5)


def test_measured_break_even_batch():
    timings = {1: (1.0, 1.1), 4: (2.0, 3.0), 16: (4.0, 12.0)}
    assert costs.measured_break_even_batch(timings, tau=3.0) == 16  # 3 * 4 / 12 = 1
    assert costs.measured_break_even_batch(timings, tau=3.0, draft_ratio=1.5) == 4  # 3 * 2 / (3 + 3) = 1
    assert costs.measured_break_even_batch({1: (1.0, 1.0)}, tau=2.0) is None


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="num_drafts"):
        costs.Drafting(tau=5.0, num_drafts=3)
    with pytest.raises(ValueError, match="spec_strategy"):
        costs.super_target("rewind")
    with pytest.raises(ValueError, match="active_weight_bytes"):
        costs.ServedModel("x", weight_bytes=1.0, active_weight_bytes=2.0, flops_per_token=1.0)
    with pytest.raises(ValueError, match="batch"):
        costs.forward_seconds(costs.E4B_TARGET, costs.H200, 0)


def test_notebook_tables_are_computed_by_costs():
    from minispec.lessons import serving_costs as lesson

    rows = {r["technique"]: r for r in lesson.deployment_table()}
    e4b = rows["E4B + DFlash"]
    assert e4b["speedup_b1"] == round(costs.speedup_at_batch(costs.E4B_TARGET, costs.H200, 1,
                                                             lesson.E4B_DFLASH_DRAFTING, 2048), 2)
    assert e4b["speedup_b1"] > e4b["speedup_b64"] > 1
    assert e4b["stops_paying_at"] == costs.break_even_batch(costs.E4B_TARGET, costs.H200, lesson.E4B_DFLASH_DRAFTING,
                                                            2048)
    native, replay = rows["Super + MTP, per-position"], rows["Super + MTP, replay"]
    assert native["speedup_b1"] < 1  # a verify forward reads more experts than a decode step
    assert replay["speedup_b64"] > native["speedup_b64"] > 1
    memory = {r["deployment"]: r for r in lesson.memory_rows()}
    assert memory["E4B + DFlash drafter"]["per_request_MiB"] == memory["E4B, plain"]["per_request_MiB"] + 20
    assert memory["Super + MTP, checkpoint + replay"]["fit_H200"] > 3 * memory["Super + MTP, per-position states"][
        "fit_H200"]
    curves = lesson.speedup_curves((1, 64))
    assert curves["E4B + DFlash, H200"][0] == pytest.approx(e4b["speedup_b1"], abs=0.005)


def test_the_numbers_notebook_06_quotes():
    """Notebook 06's prose quotes these; they are recomputed here so the words cannot drift from the model."""
    from minispec.lessons import serving_costs as lesson

    h200, b200 = lesson.e4b_margin(hw=costs.H200), lesson.e4b_margin(hw=costs.B200)
    assert (h200["speedup"], h200["cycle_in_decode_steps"], h200["break_even_tau"]) == (1.85, 2.17, 2.17)
    assert (h200["stops_paying_at"], b200["stops_paying_at"]) == (195, 543)
    assert lesson.THROUGHPUT_BATCH == 64 and h200["speedup"] > 1  # the model does not explain the 64-sequence recipe

    curves = lesson.speedup_curves()  # batches 1 .. 1024
    replay = curves["Super + MTP (replay), H200"]
    native = curves["Super + MTP (per-position), H200"]
    assert round(replay[0], 2) == 0.86 and replay[0] < 1  # slower than plain decoding at batch 1
    assert round(replay[8], 1) == 2.9 and replay[:9] == sorted(replay[:9])  # rises up to batch 256
    assert max(range(11), key=native.__getitem__) == 5  # per-position peaks at batch 32
    e4b = curves["E4B + DFlash, H200"]
    assert e4b == sorted(e4b, reverse=True) and round(e4b[0], 2) == 3.72

    reads = {r["batch"]: r for r in lesson.expert_reads()}
    assert (reads[1]["decode_step_reads_%"], reads[1]["verify_reads_%"]) == (10.0, 34.4)
    assert reads[64]["decode_step_reads_%"] > 99.5

    gains = {r["batch"]: r for r in lesson.replay_gain_rows()}
    assert round(gains[64]["replay_gain_%"]) == 36 and round(gains[64]["state_share_of_verify_bytes_%"]) == 43
    assert 5.5 < gains[8]["replay_gain_%"] < 6.5 and 10.5 < gains[16]["replay_gain_%"] < 11.5
    low, high = lesson.PAPER_REPLAY_GAIN_PERCENT["total throughput"]
    assert gains[8]["replay_gain_%"] > low and gains[4]["replay_gain_%"] < low < high < gains[16]["replay_gain_%"]
    assert round(1 + gains[256]["replay_gain_%"] / 100, 2) == 1.91
    assert abs(1 + gains[256]["replay_gain_%"] / 100 - lesson.VLLM_REPLAY_OVER_NATIVE_AT_256) < 0.05
    assert lesson.replay_gain_rows(hw=costs.H200) == lesson.replay_gain_rows(hw=costs.B200)  # both memory-bound
    native_state = costs.super_target().state_traffic(4)
    assert 0.75 * 2**30 < native_state < 0.8 * 2**30  # "about 0.8 GiB per sequence and verify"

    memory = {r["deployment"]: r for r in lesson.memory_rows()}
    replay_fit = memory["Super + MTP, checkpoint + replay"]["fit_H200"]
    assert round(replay_fit / memory["Super + MTP, per-position states"]["fit_H200"], 1) == 3.5


def test_the_speedup_figure_has_a_panel_per_kind_of_target():
    from minispec.lessons import serving_costs as lesson

    fig = lesson.plot_speedup({1: (1.0, 1.2), 4: (2.0, 4.0)})
    dense, moe = fig.axes
    assert "dense" in dense.get_title() and "mixture of experts" in moe.get_title()
    assert all(line.get_label().startswith(("E4B", "bolt-mini")) for line in dense.get_lines()
               if not line.get_label().startswith("_"))
    assert {line.get_label() for line in moe.get_lines() if not line.get_label().startswith("_")} == {
        f"Super + MTP ({s}), {hw}" for s in ("per-position", "replay") for hw in ("H200", "B200")}
