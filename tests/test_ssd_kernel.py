"""The chunked SSD scan's Triton pipeline (kernels/ssd.py) against the PyTorch reference (interpreter on CPU).

Tolerance, float32: |kernel - reference| <= 1e-5 · (1 + max |reference|), for y and for the final state,
with the float64 recurrence (`ssd_sequential`) as a second witness. The two float32 computations differ
in summation order and in how exp(cum_t - cum_s) is formed (kernels/ssd.py); at these sizes the
measured gap is about 1e-7 of the output's scale.
"""
import pytest
import torch

import minispec.kernels.ssd as ssd_kernels
from minispec.ssm.config import Mamba2Config
from minispec.ssm.hybrid import HybridLM
from minispec.ssm.mamba2 import Mamba2Mixer
from minispec.ssm.ssd import ssd_chunked, ssd_sequential

reference, kernel = ssd_chunked.reference, ssd_chunked.kernel


def inputs(b, T, H, P, N, G, seed=0, initial_state=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, B, C, D = r(b, T, H, P), r(b, T, G, N), r(b, T, G, N), r(H)
    dt = torch.rand(b, T, H, generator=g, dtype=torch.float64) * 0.5 + 0.01
    A = -torch.linspace(0.5, 3.0, H, dtype=torch.float64)
    h0 = r(b, H, P, N) if initial_state else None
    return [None if t is None else t.to(dtype) for t in (x, dt, A, B, C, D, h0)]


def close(got, ref, witness=None):
    scale = 1 + ref.abs().max().item() if ref.numel() else 1
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert (got.double() - ref.double()).abs().max().item() <= 1e-5 * scale if ref.numel() else True
    if witness is not None:
        assert (got.double() - witness).abs().max().item() <= 1e-5 * scale if ref.numel() else True


CASES = [  # (b, T, H, P, N, G, chunk_size, initial_state)
    (2, 10, 4, 6, 8, 2, 4, True),     # 3 chunks, the last of 2; P not a power of two (padded tiles); 2 groups
    (1, 7, 2, 4, 4, 1, 16, False),    # one chunk longer than T; zero initial state
    (1, 33, 4, 8, 16, 4, 8, True),    # G = H, a last chunk of 1 token
    (2, 5, 3, 5, 3, 1, 1, True),      # chunks of one token: the scan is the recurrence
    (1, 20, 2, 16, 32, 2, 5, True),   # a chunk size that is not a power of two
]


@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference_and_the_recurrence(case):
    b, T, H, P, N, G, Q, with_h0 = case
    args = inputs(b, T, H, P, N, G, initial_state=with_h0)
    y, h = kernel(*args, chunk_size=Q)
    y_ref, h_ref = reference(*args, chunk_size=Q)
    y_seq, h_seq = ssd_sequential(*inputs(b, T, H, P, N, G, initial_state=with_h0, dtype=torch.float64))
    close(y, y_ref, y_seq)
    close(h, h_ref, h_seq)


def test_without_D_and_with_no_tokens():
    x, dt, A, B, C, D, h0 = inputs(1, 6, 2, 4, 4, 1)
    y, h = kernel(x, dt, A, B, C, None, h0, chunk_size=4)
    y_ref, h_ref = reference(x, dt, A, B, C, None, h0, chunk_size=4)
    close(y, y_ref)
    close(h, h_ref)
    y0, h_end = kernel(x[:, :0], dt[:, :0], A, B[:, :0], C[:, :0], D, h0, chunk_size=4)
    assert y0.shape == (1, 0, 2, 4) and torch.equal(h_end, h0)


def test_kernel_refuses_float64_and_shares_the_reference_checks():
    args = inputs(1, 4, 2, 4, 4, 1)
    with pytest.raises(ValueError, match="float64"):
        kernel(*inputs(1, 4, 2, 4, 4, 1, dtype=torch.float64))
    for fn in (kernel, reference):
        with pytest.raises(ValueError, match="ssd_chunked: B has shape"):
            fn(args[0], args[1], args[2], args[3][:, :3], *args[4:])
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            fn(*args, chunk_size=0)


def test_the_mixer_runs_the_kernel_with_the_triton_backend_and_left_padding(monkeypatch):
    cfg = Mamba2Config(hidden_size=32, num_heads=4, head_dim=8, state_size=8, n_groups=2, chunk_size=4)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(cfg).eval()
    u = torch.randn(2, 9, 32)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        monkeypatch.setenv("MINISPEC_BACKEND", "torch")
        out_ref, st_ref = mixer(u, attention_mask=mask)
        monkeypatch.setenv("MINISPEC_BACKEND", "triton")
        calls = counting(monkeypatch)
        out, st = mixer(u, attention_mask=mask)
    assert calls == [1]
    close(out, out_ref)
    close(st.ssm, st_ref.ssm)


def counting(monkeypatch) -> list[int]:
    """Count the calls that reach the kernel module's ssd_chunked (the backend looks it up at each call)."""
    calls = []
    run = ssd_kernels.ssd_chunked

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(ssd_kernels, "ssd_chunked", counted)
    return calls


def test_lightning_mini_logits_through_the_kernel_equal_the_reference_path(monkeypatch):
    """HybridLM's prefill with MINISPEC_BACKEND=triton: every Mamba layer's scan runs the kernel pipeline."""
    model = HybridLM.from_pretrained("lightning-mini").eval()
    ids = torch.randint(3, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        monkeypatch.setenv("MINISPEC_BACKEND", "torch")
        ref = model(ids).logits
        monkeypatch.setenv("MINISPEC_BACKEND", "triton")
        calls = counting(monkeypatch)
        out = model(ids).logits
    assert len(calls) == model.pattern.count("M")  # 70 tokens: two chunks of lightning-mini's 64
    assert (out - ref).abs().max().item() <= 1e-4 * (1 + ref.abs().max().item())
