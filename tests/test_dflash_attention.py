"""DFlash's block attention: what the reference means, and the Triton kernel against it.

The kernel runs on DEVICE: under the Triton interpreter on CPU (conftest.py sets TRITON_INTERPRET=1),
compiled on a CUDA machine. Tolerance: float32 within ATOL = 1e-5 (observed ~1e-6: only the
summation order differs); bfloat16 / float16 within 2e-2 absolute + 2e-2 relative (one or two
16-bit ulps of outputs of magnitude ~1; on a GPU the kernel also rounds p to 16 bits for p @ V).
"""
import math

import pytest
import torch

from minispec import backend
from minispec.dflash.attention import dflash_attention, masked_attention

ATOL = 1e-5
TOL_16 = dict(atol=2e-2, rtol=2e-2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
reference, kernel = dflash_attention.reference, dflash_attention.kernel


def random_inputs(B, T, Hq, Hkv, D, lens, C=None, dtype=torch.float32, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    C = max(lens) if C is None else C

    def make(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return (make(B, T, Hq, D), make(B, C, Hkv, D), make(B, C, Hkv, D), make(B, T, Hkv, D), make(B, T, Hkv, D),
            torch.tensor(lens, device=device))


# --- what the reference means -----------------------------------------------------------------------

def visible_sets(lens, T, window):
    """By hand: the context slots block query t of row b sees."""
    return [[[i for i in range(n) if window is None or (n - i) + t < window] for t in range(T)] for n in lens]


@pytest.mark.parametrize("window", [None, 6, 4])
def test_reference_sees_the_window_and_the_whole_block(window):
    """q = 0 makes attention uniform over what a query sees, so the output is the mean of those values.
    Values are one-hot per key, so the output spells out the visible set."""
    B, T, C, lens = 2, 4, 9, [9, 3]
    k_ctx, k_blk = torch.randn(B, C, 1, 4), torch.randn(B, T, 1, 4)
    eye = torch.eye(C + T)  # key j carries the unit vector e_j
    v_ctx = eye[:C].expand(B, C, C + T)[:, :, None, :]
    v_blk = eye[C:].expand(B, T, C + T)[:, :, None, :]
    q = torch.zeros(B, T, 1, C + T)
    k_ctx, k_blk = torch.zeros(B, C, 1, C + T), torch.zeros(B, T, 1, C + T)
    out = reference(q, k_ctx, v_ctx, k_blk, v_blk, torch.tensor(lens), window)[:, :, 0]  # [B, T, C + T]
    for b, row in enumerate(visible_sets(lens, T, window)):
        for t, ctx in enumerate(row):
            seen = ctx + list(range(C, C + T))  # every block key, in both directions
            expected = torch.zeros(C + T)
            expected[seen] = 1 / len(seen)
            assert torch.allclose(out[b, t], expected, atol=1e-6), (b, t, out[b, t])


def test_reference_is_softmax_attention_with_grouped_heads():
    q, k_ctx, v_ctx, k_blk, v_blk, lens = random_inputs(1, 3, 4, 2, 8, [5], device="cpu")
    out = reference(q, k_ctx, v_ctx, k_blk, v_blk, lens, None)
    k, v = torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1)
    for h in range(4):
        g = h // 2  # heads 0, 1 read kv head 0; heads 2, 3 read kv head 1
        weights = torch.softmax(q[0, :, h] @ k[0, :, g].T / math.sqrt(8), dim=-1)
        assert torch.allclose(out[0, :, h], weights @ v[0, :, g], atol=1e-6)


def test_reference_equals_the_training_attention_of_one_block():
    """The inference attention is masked_attention with the mask the training mask gives one block."""
    q, k_ctx, v_ctx, k_blk, v_blk, lens = random_inputs(2, 4, 2, 1, 8, [7, 3], C=7, device="cpu")
    T, window = 4, 5
    out = reference(q, k_ctx, v_ctx, k_blk, v_blk, lens, window)
    for b, n in enumerate(lens.tolist()):
        # Context at positions 0..n-1, anchor at n: query t (position n + t) sees c < n with n + t - c < W.
        allow = torch.tensor([[c < n and n + t - c < window for c in range(n)] + [True] * T for t in range(T)])
        alone = masked_attention(q[b:b + 1], torch.cat([k_ctx[b:b + 1, :n], k_blk[b:b + 1]], 1),
                                 torch.cat([v_ctx[b:b + 1, :n], v_blk[b:b + 1]], 1), allow[None])
        assert torch.allclose(out[b], alone[0], atol=1e-6)


def test_masked_attention_rows_that_see_nothing_are_zero_and_finite():
    q, k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 3, 1, 4), torch.randn(1, 3, 1, 4)
    allow = torch.tensor([[[True, False, True], [False, False, False]]])
    q.requires_grad_(True)
    out = masked_attention(q, k, v, allow)
    assert torch.equal(out[0, 1], torch.zeros(2, 4))
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


# --- the kernel against the reference ----------------------------------------------------------------

CASES = [  # B, T, Hq, Hkv, D, ctx_lens, window
    (3, 8, 4, 2, 32, [0, 5, 40], None),  # an empty context, GQA 2
    (3, 8, 3, 1, 64, [3, 17, 40], 12),  # bolt-mini's heads (GQA 3), window cuts into the context
    (2, 5, 2, 2, 24, [7, 2], 5),  # odd block length, head dim not a power of two, window = T
    (2, 16, 4, 1, 16, [70, 33], 40),  # block 16, context over two tiles
    (1, 8, 8, 8, 32, [100], None),  # no GQA, context of four tiles
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,lens,window", CASES)
def test_kernel_equals_reference(B, T, Hq, Hkv, D, lens, window):
    args = random_inputs(B, T, Hq, Hkv, D, lens)
    out = kernel(*args, window)
    assert out.shape == (B, T, Hq, D) and out.dtype == torch.float32
    assert torch.allclose(out, reference(*args, window), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_reference_in_16_bit(dtype):
    args = random_inputs(2, 8, 4, 1, 32, [50, 9], dtype=dtype, seed=1)
    out = kernel(*args, 20)
    assert out.dtype == dtype
    assert torch.allclose(out.float(), reference(*args, 20).float(), **TOL_16)


def test_kernel_takes_strided_views_and_a_context_wider_than_used():
    q, k_ctx, v_ctx, k_blk, v_blk, lens = random_inputs(2, 8, 2, 1, 32, [10, 4], C=24, seed=2)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    k_ctx[:, 10:] = float("nan")  # slots past ctx_lens must never be read into the result
    v_ctx[:, 10:] = float("nan")
    out = kernel(q_t, k_ctx, v_ctx, k_blk, v_blk, lens, 9)
    assert torch.allclose(out, reference(q, k_ctx.nan_to_num(), v_ctx.nan_to_num(), k_blk, v_blk, lens, 9),
                          atol=ATOL)


def test_kernel_with_an_explicit_scale_and_no_context_tensor():
    q, _, _, k_blk, v_blk, _ = random_inputs(2, 4, 2, 2, 16, [1], seed=3)
    empty = torch.zeros(2, 0, 2, 16, device=DEVICE)
    lens = torch.zeros(2, dtype=torch.long, device=DEVICE)
    out = kernel(q, empty, empty, k_blk, v_blk, lens, None, 0.3)
    assert torch.allclose(out, reference(q, empty, empty, k_blk, v_blk, lens, None, 0.3), atol=ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_reference_on_cuda_at_e4b_shapes(dtype):
    # E4B's drafter: 32 q / 8 kv heads of 128, block 8, window 1024; 16 sequences of ragged context.
    lens = [1023, 1, 500, 1023, 7, 64, 1000, 300] * 2
    args = random_inputs(16, 8, 32, 8, 128, lens, dtype=dtype, seed=4, device="cuda")
    tol = dict(atol=ATOL, rtol=0) if dtype == torch.float32 else TOL_16
    assert torch.allclose(kernel(*args, 1024).float(), reference(*args, 1024).float(), **tol)


# --- bad input ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [reference, kernel], ids=["reference", "kernel"])
def test_bad_input_says_what_is_wrong(fn):
    q, k_ctx, v_ctx, k_blk, v_blk, lens = random_inputs(2, 4, 3, 2, 8, [3, 2])
    with pytest.raises(ValueError, match="multiple of the kv heads"):
        fn(q, k_ctx, v_ctx, k_blk, v_blk, lens)
    q = q[:, :, :2]
    with pytest.raises(ValueError, match=r"ctx_lens must lie in \[0, 3\]"):
        fn(q, k_ctx, v_ctx, k_blk, v_blk, torch.tensor([4, 1], device=DEVICE))
    with pytest.raises(ValueError, match="window must be None or an int >= the block length T=4"):
        fn(q, k_ctx, v_ctx, k_blk, v_blk, lens, 3)
    with pytest.raises(ValueError, match="k_blk and v_blk"):
        fn(q, k_ctx, v_ctx, k_blk[:, :3], v_blk, lens)
    with pytest.raises(ValueError, match="integer tensor"):
        fn(q, k_ctx, v_ctx, k_blk, v_blk, lens.float())


def test_kernel_rejects_mixed_dtypes():
    q, k_ctx, v_ctx, k_blk, v_blk, lens = random_inputs(1, 4, 2, 1, 16, [3])
    with pytest.raises(ValueError, match="share one float dtype"):
        kernel(q.half(), k_ctx, v_ctx, k_blk, v_blk, lens)


@pytest.mark.parametrize("name,reference_runs", [("torch", True), ("auto", DEVICE == "cpu"), ("triton", False)])
def test_dispatch_follows_minispec_backend(monkeypatch, name, reference_runs):
    """A fresh dispatched function whose reference only records that it ran."""
    ran = []

    def fake_reference(q, *args, **kwargs):
        ran.append(True)
        return torch.zeros_like(q)

    fn = backend.dispatch("attention:dflash_attention")(fake_reference)
    monkeypatch.setenv("MINISPEC_BACKEND", name)
    args = random_inputs(1, 4, 2, 1, 16, [5])
    out = fn(*args, None)
    assert bool(ran) == reference_runs
    if not reference_runs:  # the kernel ran: real attention, not the fake zeros
        assert torch.allclose(out, reference(*args, None), atol=ATOL)


def test_the_drafter_runs_the_kernel_in_the_speculative_loop(monkeypatch):
    """MINISPEC_BACKEND=triton routes the drafter's attention to the kernel: same draft logits, and
    speculative decoding still equals plain decoding."""
    import minispec as ms
    from minispec.dflash.config import DFlashConfig
    from minispec.dflash.drafter import DFlashDrafter
    from minispec.dflash.model import DFlashDraftModel
    from minispec.speculative.batch import as_prompt_batch
    from minispec.speculative.target import HFTarget
    from tiny import tiny_gemma

    target = tiny_gemma(layers=6, window=16, seed=0)
    config = DFlashConfig.for_target(target.config, [1, 4], 3, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=10)
    torch.manual_seed(0)
    model = DFlashDraftModel.for_target(config, target)
    prompts = [torch.arange(10, 51), torch.arange(300, 323)]
    batch = as_prompt_batch(prompts, 0)
    drafter = DFlashDrafter(model, target)
    drafter.begin(batch, HFTarget(target, output_hidden_states=True).prefill(batch))
    block = torch.tensor([[7] + [3] * 7, [9] + [3] * 7])
    logits = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("MINISPEC_BACKEND", name)
        logits[name] = model.draft(block, drafter.cache)
    assert torch.allclose(logits["triton"], logits["torch"], atol=1e-4)
    # Still under MINISPEC_BACKEND=triton: a whole generation with the kernel in the loop.
    ar = ms.autoregressive_generate(target, prompts, 8)
    spec = ms.speculative_generate(target, DFlashDrafter(model, target), prompts, 8)
    assert torch.equal(spec.tokens, ar.tokens)
