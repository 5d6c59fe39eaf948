"""The checkpoint + replay Triton kernels against the PyTorch reference (interpreter on CPU)."""
import pytest
import torch

from minispec.ssm.replay import replay_flush, replay_verify


def records(b, L, H, P, N, G, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g)

    out = (r(b, H, P, N), r(b, L, H, P), torch.rand(b, L, H, generator=g) * 0.5 + 0.01, r(b, L, G, N),
           -torch.linspace(0.5, 3, H), r(H))
    return [t.to(device) for t in out]


SHAPES = [  # (b, H, P, N, G, L, start)
    (1, 2, 4, 8, 1, 1, 0),   # buffer of one: plain decode
    (2, 4, 6, 8, 2, 9, 5),   # non-power-of-2 P, a window of 4 on 5 committed records
    (1, 4, 8, 4, 4, 16, 0),  # a full ring, all of it the window (G = H)
    (2, 2, 4, 16, 1, 16, 15),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_verify_kernel_equals_reference(shape):
    b, H, P, N, G, L, start = shape
    S0, x, dt, B, A, D = records(b, L, H, P, N, G)
    C = torch.randn(b, L - start, G, N, generator=torch.Generator().manual_seed(9))
    ref = replay_verify.reference(S0, x, dt, B, C, A, D, start)
    got = replay_verify.kernel(S0, x, dt, B, C, A, D, start)
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())


@pytest.mark.parametrize("shape", SHAPES)
def test_flush_kernel_equals_reference(shape):
    b, H, P, N, G, L, _ = shape
    S0, x, dt, B, A, _ = records(b, L, H, P, N, G, seed=1)
    ref = replay_flush.reference(S0, x, dt, B, A)
    got = replay_flush.kernel(S0, x, dt, B, A)
    assert (got - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    assert torch.equal(replay_flush.kernel(S0, x[:, :0], dt[:, :0], B[:, :0], A), S0)


def test_kernel_refuses_bad_shapes():
    S0, x, dt, B, A, D = records(1, 4, 2, 4, 8, 1)
    with pytest.raises(ValueError, match="C must be"):
        replay_verify.kernel(S0, x, dt, B, torch.zeros(1, 3, 1, 8), A, D, 2)
    with pytest.raises(ValueError, match="dt must be"):
        replay_flush.kernel(S0, x, dt[:, :2], B, A)


@pytest.mark.parametrize("side", ["reference", "kernel"])
def test_reference_and_kernel_share_their_checks(side):
    """One set of checks (`check_replay_verify_args`), so both sides refuse the same input the same way."""
    S0, x, dt, B, A, D = records(1, 4, 2, 4, 8, 1)
    C = torch.zeros(1, 2, 1, 8)
    verify = getattr(replay_verify, side)
    with pytest.raises(ValueError, match=r"replay_verify: D must be \[H\] = \(2,\)"):
        verify(S0, x, dt, B, C, A, D[:1], 2)
    with pytest.raises(ValueError, match=r"replay_verify: start must be an int in \[0, L\) = \[0, 4\)"):
        verify(S0, x, dt, B, C, A, D, 4)
    with pytest.raises(ValueError, match="replay_verify: start must be an int"):
        verify(S0, x, dt, B, C, A, D, 2.0)
    with pytest.raises(ValueError, match="replay_flush: A must be"):
        getattr(replay_flush, side)(S0, x, dt, B, A[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 128, 64, 128, 8, 16, 12), (64, 16, 64, 128, 2, 20, 16)])
def test_kernels_on_cuda_super_shapes(shape):
    b, H, P, N, G, L, start = shape
    S0, x, dt, B, A, D = records(b, L, H, P, N, G, device="cuda")
    C = torch.randn(b, L - start, G, N, device="cuda")
    ref = replay_verify.reference(S0.double(), x.double(), dt.double(), B.double(), C.double(), A.double(),
                                  D.double(), start)
    got = replay_verify(S0, x, dt, B, C, A, D, start)
    assert (got.double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())
    ref = replay_flush.reference(S0.double(), x.double(), dt.double(), B.double(), A.double())
    got = replay_flush(S0, x, dt, B, A)
    assert (got.double() - ref).abs().max() <= 1e-4 * (1 + ref.abs().max())


def test_replay_store_runs_on_the_kernels(monkeypatch):
    """The whole checkpoint + replay store, its verify and flush dispatched to the Triton kernels."""
    from test_replay import run_random_acceptance

    monkeypatch.setenv("MINISPEC_BACKEND", "triton")
    err, store = run_random_acceptance("replay", torch.float32, steps=12, T=4, capacity=6)
    assert err <= 1e-5 and store.flushes >= 3
