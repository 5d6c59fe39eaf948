"""Checkpoint + replay and per-position states: exact against plain sequential decoding."""
import math

import pytest
import torch

from minispec.ssm.config import Mamba2Config
from minispec.ssm.mamba2 import Mamba2Mixer
from minispec.ssm.replay import CheckpointReplay, PerPositionStates, make_store, replay_flush, replay_verify
from minispec.ssm.ssd import ssd_sequential
from minispec.ssm.state import Mamba2State, Mamba2StateError

CFG = Mamba2Config(hidden_size=24, num_heads=4, head_dim=6, state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
                   time_step_limit=(0.0, math.inf))


def mixer(dtype, seed=0):
    torch.manual_seed(seed)
    m = Mamba2Mixer(CFG, layer_idx=0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
        m.A_log.copy_(torch.log(torch.linspace(0.5, 3.0, CFG.num_heads)))
    return m.to(dtype).eval()


def records(b, L, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    H, P, N, G = CFG.num_heads, CFG.head_dim, CFG.state_size, CFG.n_groups

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    return (r(b, H, P, N), r(b, L, H, P), torch.rand(b, L, H, generator=g, dtype=dtype) * 0.5 + 0.01,
            r(b, L, G, N), r(b, L, G, N), -torch.linspace(0.5, 2, H, dtype=dtype), r(H))


def test_replay_formula_equals_the_recurrence():
    S0, x, dt, B, C, A, D = records(2, 11, torch.float64)
    y_seq, h_seq = ssd_sequential(x, dt, A, B, C, D, initial_state=S0)
    for start in (0, 3, 10):
        y = replay_verify(S0, x, dt, B, C[:, start:], A, D, start)
        assert (y - y_seq[:, start:]).abs().max() < 1e-12
    assert (replay_flush(S0, x, dt, B, A) - h_seq).abs().max() < 1e-12
    assert torch.equal(replay_flush(S0, x[:, :0], dt[:, :0], B[:, :0], A), S0)


def run_random_acceptance(strategy, dtype, steps, T, capacity=16, seed=0):
    """Drive a store with random acceptance; compare every window output and committed state with
    mixer.step over exactly the same tokens from the same committed state. Returns (max err, store)."""
    m = mixer(dtype)
    g = torch.Generator().manual_seed(seed)
    store = make_store(strategy, m, m.init_state(2, dtype=dtype), capacity)
    truth = m.init_state(2, dtype=dtype)
    prompt = torch.randn(2, 9, CFG.hidden_size, generator=g, dtype=dtype)
    out = store.extend(prompt)
    ref, truth = m(prompt, truth)
    err = (out - ref).abs().max().item()
    for _ in range(steps):
        t = int(torch.randint(1, T + 1, (), generator=g))  # ragged windows, T = 1 included
        u = torch.randn(2, t, CFG.hidden_size, generator=g, dtype=dtype)
        y = store.verify(u)
        n = int(torch.randint(1, t + 1, (), generator=g))  # n = 1: zero drafts accepted
        st, ys = truth, []
        for k in range(t):
            yk, st = m.step(u[:, k], st)
            ys.append(yk)
            if k + 1 == n:
                kept = st
        err = max(err, (y - torch.stack(ys, 1)).abs().max().item())
        store.commit(n)
        truth = kept
        got = store.state()
        err = max(err, (got.ssm - truth.ssm).abs().max().item(), (got.conv - truth.conv).abs().max().item())
    return err, store


@pytest.mark.parametrize("strategy", ["replay", "per-position"])
def test_exact_over_hundreds_of_random_steps_float64(strategy):
    err, store = run_random_acceptance(strategy, torch.float64, steps=300, T=5)
    assert err <= 1e-10
    if strategy == "replay":
        assert store.flushes > 40  # the ring really was folded many times


@pytest.mark.parametrize("strategy", ["replay", "per-position"])
def test_exact_over_hundreds_of_random_steps_float32(strategy):
    err, _ = run_random_acceptance(strategy, torch.float32, steps=200, T=5)
    assert err <= 1e-5


def test_buffer_of_one_is_plain_decoding():
    err, store = run_random_acceptance("replay", torch.float64, steps=40, T=1, capacity=1)
    assert err <= 1e-12
    assert store.flushes == 39  # every token but the first is folded before the next one


def test_flush_lands_exactly_on_a_boundary():
    m = mixer(torch.float64)
    store = CheckpointReplay(m, m.init_state(1, dtype=torch.float64), capacity=8)
    truth = m.init_state(1, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        u = torch.randn(1, 4, CFG.hidden_size, generator=g, dtype=torch.float64)
        y = store.verify(u)
        ref, truth = m(u, truth)
        store.commit(4)
        assert (y - ref).abs().max() < 1e-12
        assert store.count == (4 if step % 2 == 0 else 8)  # full to the last record, never over
    assert store.flushes == 1  # only before window 3 (8 + 4 > 8); window 4 fills the ring to exactly 8 again
    assert (store.state().ssm - truth.ssm).abs().max() < 1e-12


def test_traffic_per_position_vs_replay():
    m = mixer(torch.float32)
    s_pp = PerPositionStates(m, m.init_state(1))
    s_rp = CheckpointReplay(m, m.init_state(1), capacity=16)
    u = torch.randn(1, 4, CFG.hidden_size)
    for s in (s_pp, s_rp):
        s.verify(u)
        s.commit(4)
    state_bytes = m.init_state(1).nbytes()
    assert s_pp.traffic.written == 4 * state_bytes and s_pp.traffic.read == state_bytes
    H, P, N, G, C = CFG.num_heads, CFG.head_dim, CFG.state_size, CFG.n_groups, CFG.conv_dim
    assert s_rp.traffic.written == 4 * 4 * (H * P + G * N + H + C)  # 4 records, fp32, no state
    assert s_rp.traffic.committed == 4


def test_bad_input_is_refused():
    m = mixer(torch.float32)
    with pytest.raises(ValueError, match="capacity"):
        CheckpointReplay(m, m.init_state(1), capacity=0)
    store = CheckpointReplay(m, m.init_state(1), capacity=4)
    with pytest.raises(ValueError, match="does not fit a buffer of 4"):
        store.verify(torch.randn(1, 5, CFG.hidden_size))
    with pytest.raises(ValueError, match="nothing was verified"):
        store.commit(1)
    store.verify(torch.randn(1, 3, CFG.hidden_size))
    with pytest.raises(ValueError, match="only 3 token"):
        store.commit(4)
    with pytest.raises(ValueError, match="not committed"):
        store.verify(torch.randn(1, 1, CFG.hidden_size))
    good = m.init_state(1)
    with pytest.raises(Mamba2StateError, match="ssm dtype"):
        CheckpointReplay(m, Mamba2State(conv=good.conv, ssm=good.ssm.double()))
    with pytest.raises(Mamba2StateError, match="ssm state has shape"):
        PerPositionStates(m, Mamba2State(conv=good.conv, ssm=good.ssm[:, :, :, :4]))
    with pytest.raises(Mamba2StateError, match="activation dtype"):
        CheckpointReplay(m, m.init_state(1, dtype=torch.float64))
    bad = good.clone()
    bad.ssm[0, 1, 2, 3] = float("nan")
    with pytest.raises(Mamba2StateError, match="NaN"):
        CheckpointReplay(m, bad)
    with pytest.raises(ValueError, match="unknown Mamba state strategy"):
        make_store("crop", m, good)


def test_nan_in_records_is_caught_at_the_flush():
    m = mixer(torch.float32)
    store = CheckpointReplay(m, m.init_state(1), capacity=2)
    store.verify(torch.randn(1, 2, CFG.hidden_size))
    store.commit(2)
    store.x[0, 1, 0, 0] = float("nan")  # a poisoned record (e.g. uninitialised memory)
    with pytest.raises(Mamba2StateError, match="non-finite"):
        store.verify(torch.randn(1, 1, CFG.hidden_size))


# --- the byte model ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["replay", "per-position"])
def test_byte_model_equals_what_the_stores_count(strategy):
    from minispec import costs
    shape = costs.LIGHTNING_MINI_MAMBA2
    cfg = Mamba2Config(hidden_size=16, num_heads=shape.num_heads, head_dim=shape.head_dim,
                       state_size=shape.state_size, n_groups=shape.n_groups, conv_kernel=shape.conv_kernel)
    m = Mamba2Mixer(cfg).eval()
    store = make_store(strategy, m, m.init_state(1), capacity=16)
    steps, T, n = 20, 4, 3
    for _ in range(steps):
        store.verify(torch.randn(1, T, 16))
        store.commit(n)
    model = costs.spec_state_traffic(shape, T, n, strategy, capacity=16, state_bytes=4, act_bytes=4, steps=steps)
    assert store.traffic.written == pytest.approx(model.written_per_step * steps, rel=1e-12)
    assert store.traffic.read == pytest.approx(model.read_per_step * steps, rel=1e-12)
    assert store.traffic.committed == steps * n


def test_replay_writes_at_least_4x_fewer_state_bytes_at_T4():
    from minispec import costs
    MiB = 2**20
    for shape in (costs.SUPER_MAMBA2, costs.LIGHTNING_MINI_MAMBA2):
        for n in (1, 2, 3, 4):  # however many drafts are accepted
            pp = costs.spec_state_traffic(shape, 4, n, "per-position")
            rp = costs.spec_state_traffic(shape, 4, n, "replay")
            assert pp.written_per_token >= 4 * rp.written_per_token
    pp = costs.spec_state_traffic(costs.SUPER_MAMBA2, 4, 3, "per-position")
    conv = 3 * (128 * 64 + 2 * 8 * 128) * 2
    assert pp.written_per_step == 4 * (4 * MiB + conv)  # T states written per verify step
    rp = costs.spec_state_traffic(costs.SUPER_MAMBA2, 4, 3, "replay")
    # a record: bf16 x|B (8192 + 1024 values) and fp32 dt (128), then the bf16 pre-conv column
    record = (8192 + 1024) * 2 + 128 * 4 + (128 * 64 + 2 * 8 * 128) * 2
    assert rp.memory_per_request == 4 * MiB + conv + 16 * record  # 1 state + a ring of 16
    assert pp.memory_per_request / rp.memory_per_request > 3  # vs T states
    with pytest.raises(ValueError, match="does not fit"):
        costs.spec_state_traffic(costs.SUPER_MAMBA2, 17, 3, "replay")
    with pytest.raises(ValueError, match="cannot exceed"):
        costs.spec_state_traffic(costs.SUPER_MAMBA2, 4, 5, "replay")


def test_step_log_and_timeline():
    from minispec.lessons.mamba_replay import replay_timeline, step_log
    m = mixer(torch.float32)
    stores = [CheckpointReplay(m, m.init_state(1), capacity=8), PerPositionStates(m, m.init_state(1))]
    for s in stores:
        for n in (2, 4, 1, 3):  # windows of 4: fills 2, 6, then 6 + 4 > 8 forces a flush before step 3
            s.verify(torch.randn(1, 4, CFG.hidden_size))
            s.commit(n)
    rows, naive = step_log(stores[0]), step_log(stores[1])
    assert [r["fill_before"] for r in rows] == [0, 2, 0, 1] and [r["flushed"] for r in rows] == [0, 0, 1, 0]
    assert [r["rejected"] for r in rows] == [2, 0, 3, 1]
    assert rows[2]["written"] > rows[1]["written"]  # the flush writes the checkpoint
    assert all(r["written"] == 4 * m.init_state(1).nbytes() for r in naive)  # T states every step
    fig = replay_timeline(rows, naive, capacity=8)
    assert len(fig.axes) == 2


def test_bench_bytes_table():
    from minispec.bench.replay import bytes_rows
    rows = bytes_rows()
    assert [(r["shape"], r["T"]) for r in rows] == [(s, T) for s in ("Super", "lightning-mini") for T in (2, 4, 7)]
    assert all(r["write_ratio"] >= 4 for r in rows if r["T"] == 4)
    assert all(r["rp_mem_KiB"] < r["pp_mem_KiB"] for r in rows)
