"""Mamba-2 reference (minispec.ssm: ssd, state, mamba2): the chunked SSD scan equals the step recurrence, prefill
then decode equals one long prefill, the rolling conv window equals the full convolution, the mixer
equals transformers' NemotronH Mamba-2 mixer on the same weights, poisoned states and bad shapes give
clear errors.

Exactness tests run in float64 against `ssd_sequential` (a loop of `ssd_step`, the spec). The
transformers comparison runs in float32: transformers' torch fallbacks compute in float32 even for
float64 inputs, so it can only agree at the float32 level.
"""
import dataclasses
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from minispec.ssm.config import Mamba2Config
from minispec.ssm.mamba2 import Mamba2Mixer, split_projection
from minispec.ssm.ssd import causal_conv1d, discretize, gated_rms_norm, segsum, ssd_chunked, ssd_sequential, ssd_step
from minispec.ssm.state import Mamba2State, Mamba2StateError, check_state, conv_state_from_hf, conv_state_to_hf

F64 = torch.float64
TINY = dict(hidden_size=24, num_heads=6, head_dim=4, state_size=8, n_groups=2, conv_kernel=4, chunk_size=8)


def random_ssd_inputs(b, T, H, P, G, N, seed, dtype=F64, strong_decay=False):
    """x [b,T,H,P], dt [b,T,H] > 0, A [H] < 0, B, C [b,T,G,N], D [H], h0 [b,H,P,N]."""
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=dtype)

    dt = F.softplus(r(b, T, H) - 1.0)
    A = -torch.exp(r(H))
    if strong_decay:  # log-decays down to about -100 per token: exp() underflows inside a chunk
        A = A * 60
    return r(b, T, H, P), dt, A, r(b, T, G, N), r(b, T, G, N), r(H), r(b, H, P, N)


def randomize_(module, seed, dt_range=(0.05, 1.0)):
    """Give every parameter of a mixer (ours or transformers') a random value; dt = softplus(dt_bias + ...)
    is kept in dt_range for dt_raw = 0 by drawing dt_bias as the inverse softplus of a log-uniform value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name == "dt_bias":
                lo, hi = math.log(dt_range[0]), math.log(dt_range[1])
                dt0 = torch.exp(lo + torch.rand(p.shape, generator=g, dtype=F64) * (hi - lo))
                p.copy_(dt0 + torch.log(-torch.expm1(-dt0)))
            elif name == "A_log":
                p.copy_(torch.rand(p.shape, generator=g, dtype=F64) * 2.0 - 1.0)
            elif name == "norm.weight":
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g, dtype=F64))
            elif name == "in_proj.weight":
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) / math.sqrt(p.shape[1]))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=F64))
    return module


def tiny_mixer(dtype=F64, seed=0, **overrides):
    cfg = Mamba2Config(**{**TINY, **overrides})
    return randomize_(Mamba2Mixer(cfg, layer_idx=3), seed).to(dtype)


def maxerr(a, b):
    return (a - b).abs().max().item()


# ----------------------------------------------------------------------------------------------------
# (1) the chunked scan equals the recurrence
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,chunk", [(1, 8), (7, 8), (8, 8), (9, 8), (21, 8), (24, 8), (13, 1), (13, 64)])
@pytest.mark.parametrize("G", [1, 2, 6])
def test_chunked_equals_sequential_float64(T, chunk, G):
    x, dt, A, B, C, D, h0 = random_ssd_inputs(2, T, 6, 4, G, 5, seed=T * 10 + G)
    y_seq, h_seq = ssd_sequential(x, dt, A, B, C, D, h0)
    y_chk, h_chk = ssd_chunked(x, dt, A, B, C, D, h0, chunk_size=chunk)
    assert maxerr(y_chk, y_seq) <= 1e-10
    assert maxerr(h_chk, h_seq) <= 1e-10
    # and from the zero state
    y0, h0_end = ssd_chunked(x, dt, A, B, C, D, None, chunk_size=chunk)
    y0_seq, h0_seq = ssd_sequential(x, dt, A, B, C, D)
    assert maxerr(y0, y0_seq) <= 1e-10 and maxerr(h0_end, h0_seq) <= 1e-10
    # without the D skip
    y_nod, _ = ssd_chunked(x, dt, A, B, C, None, h0, chunk_size=chunk)
    assert maxerr(y_nod + D[:, None] * x, y_seq) <= 1e-10


def test_chunked_strong_decay_no_nan():
    """Decays that underflow to 0 inside a chunk must give 0, not NaN (inf - inf or 0 * inf)."""
    x, dt, A, B, C, D, h0 = random_ssd_inputs(2, 19, 6, 4, 2, 5, seed=7, strong_decay=True)
    y_seq, h_seq = ssd_sequential(x, dt, A, B, C, D, h0)
    y_chk, h_chk = ssd_chunked(x, dt, A, B, C, D, h0, chunk_size=8)
    assert torch.isfinite(y_chk).all() and torch.isfinite(h_chk).all()
    assert maxerr(y_chk, y_seq) <= 1e-10 and maxerr(h_chk, h_seq) <= 1e-10


def test_step_and_closed_form_decay_indices():
    """The decay-index trap, checked against the closed form:
    y_t = exp(cum_t) (h0 C_t) + sum_{i<=t} (C_t . B_i) dt_i exp(cum_t - cum_i) x_i + D x_t,
    where cum_t includes token t's own log-decay and exp(cum_t - cum_i) excludes token i's."""
    b, T, H, P, G, N = 1, 5, 2, 3, 1, 4
    x, dt, A, B, C, D, h0 = random_ssd_inputs(b, T, H, P, G, N, seed=3)
    y_seq, _ = ssd_sequential(x, dt, A, B, C, D, h0)
    cum = torch.cumsum(dt * A, dim=1)  # [b, T, H]
    for t in range(T):
        for h in range(H):
            want = torch.exp(cum[0, t, h]) * (h0[0, h] @ C[0, t, 0]) + D[h] * x[0, t, h]
            for i in range(t + 1):
                w = (C[0, t, 0] @ B[0, i, 0]) * dt[0, i, h] * torch.exp(cum[0, t, h] - cum[0, i, h])
                want = want + w * x[0, i, h]
            assert maxerr(y_seq[0, t, h], want) <= 1e-12


def test_segsum():
    la = torch.tensor([-0.5, -1.0, -2.0], dtype=F64)
    S = segsum(la)
    want = torch.tensor([[0.0, -math.inf, -math.inf], [-1.0, 0.0, -math.inf], [-3.0, -2.0, 0.0]], dtype=F64)
    assert torch.equal(S, want)


# ----------------------------------------------------------------------------------------------------
# (2) prefill then decode equals one long prefill; (3) the conv window rolls
# ----------------------------------------------------------------------------------------------------


def test_forward_then_steps_equals_longer_forward_float64():
    mixer = tiny_mixer()
    g = torch.Generator().manual_seed(1)
    T, n = 11, 6
    u = torch.randn(2, T + n, TINY["hidden_size"], generator=g, dtype=F64)
    y_full, s_full = mixer(u)
    y_pre, s = mixer(u[:, :T])
    assert maxerr(y_pre, y_full[:, :T]) <= 1e-12
    for i in range(n):
        y_t, s = mixer.step(u[:, T + i], s)
        assert y_t.shape == (2, TINY["hidden_size"])
        assert maxerr(y_t, y_full[:, T + i]) <= 1e-10
    assert maxerr(s.ssm, s_full.ssm) <= 1e-10 and maxerr(s.conv, s_full.conv) <= 1e-12
    # a multi-token window from a cached state (what a verify step does), and [b, 1, D] steps
    _, s = mixer(u[:, :T])
    y_win, s_win = mixer(u[:, T : T + 4], s)
    assert maxerr(y_win, y_full[:, T : T + 4]) <= 1e-10
    y_1, _ = mixer.step(u[:, T : T + 1], s)
    assert y_1.shape == (2, 1, TINY["hidden_size"]) and maxerr(y_1[:, 0], y_full[:, T]) <= 1e-10
    # a prompt shorter than the conv window, then steps
    _, s2 = mixer(u[:, :2])
    for i in range(2, 5):
        y_t, s2 = mixer.step(u[:, i], s2)
        assert maxerr(y_t, y_full[:, i]) <= 1e-10


def test_scan_inputs_and_output_compose_to_forward():
    """The halves around the scan (what checkpoint + replay builds on): any scan in between gives forward()."""
    mixer = tiny_mixer(seed=2)
    u = torch.randn(2, 10, TINY["hidden_size"], generator=torch.Generator().manual_seed(3), dtype=F64)
    y_ref, s_ref = mixer(u[:, 4:], mixer(u[:, :4])[1])
    _, s = mixer(u[:, :4])
    si = mixer.scan_inputs(u[:, 4:], s)
    assert si.x.shape == (2, 6, 6, 4) and si.dt.shape == (2, 6, 6) and si.B.shape == (2, 6, 2, 8)
    y, h = ssd_sequential(si.x, si.dt, si.A, si.B, si.C, si.D, s.ssm)
    assert maxerr(mixer.scan_output(y, si.z), y_ref) <= 1e-10 and maxerr(h, s_ref.ssm) <= 1e-10
    assert torch.equal(si.conv, s_ref.conv)


def test_decode_from_empty_state_equals_forward():
    mixer = tiny_mixer(seed=5)
    u = torch.randn(1, 9, TINY["hidden_size"], generator=torch.Generator().manual_seed(2), dtype=F64)
    y_full, s_full = mixer(u)
    s = None
    for t in range(9):
        y_t, s = mixer.step(u[:, t], s)
        assert maxerr(y_t, y_full[:, t]) <= 1e-10
    assert maxerr(s.ssm, s_full.ssm) <= 1e-10


@pytest.mark.parametrize("K", [1, 2, 4])
def test_conv_rolling_state_equals_full_convolution(K):
    g = torch.Generator().manual_seed(K)
    b, T, Cn = 2, 9, 5
    u = torch.randn(b, T, Cn, generator=g, dtype=F64)
    w = torch.randn(Cn, 1, K, generator=g, dtype=F64)
    bias = torch.randn(Cn, generator=g, dtype=F64)
    # an independent oracle: torch's own convolution, left-padded, cut to the first T outputs
    oracle = F.conv1d(u.transpose(1, 2), w, bias, padding=K - 1, groups=Cn)[..., :T].transpose(1, 2)
    full, state = causal_conv1d(u, w, bias)
    assert maxerr(full, oracle) <= 1e-13
    assert torch.equal(state, u.transpose(1, 2)[..., T - (K - 1) :])  # the last K-1 inputs, oldest first
    s = None
    for t in range(T):  # token by token: the rolling window
        out_t, s = causal_conv1d(u[:, t : t + 1], w, bias, s)
        assert maxerr(out_t[:, 0], oracle[:, t]) <= 1e-13
    assert torch.equal(s, state)
    a, s = causal_conv1d(u[:, :1], w, bias)  # one token, then the rest: state padded with zeros
    rest, s = causal_conv1d(u[:, 1:], w, bias, s)
    assert maxerr(torch.cat([a, rest], 1), oracle) <= 1e-13 and torch.equal(s, state)
    # transformers keeps K columns; the extra (oldest) one is never read
    assert torch.equal(conv_state_from_hf(conv_state_to_hf(state)), state)


# ----------------------------------------------------------------------------------------------------
# (4) equality with transformers' NemotronH Mamba-2 mixer
# ----------------------------------------------------------------------------------------------------

# transformers picks the mamba_ssm / causal_conv1d Triton kernels whenever those packages import,
# even for CPU tensors (DESIGN.md, known pitfalls); this comparison is against its torch fallbacks.
HF_KERNELS = [m for m in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(m) is not None]
needs_hf_torch = pytest.mark.skipif(
    bool(HF_KERNELS), reason=f"{HF_KERNELS} installed: transformers would run CUDA kernels, not its torch code"
)


def hf_pair(seed=0, dt_range=(0.05, 1.0), **overrides):
    """A transformers NemotronH mixer with random weights, our mixer with the same state dict, and the
    HF config (float32). Loading the state dict strictly both ways proves names and shapes agree."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    ours_cfg = Mamba2Config(**{**TINY, **overrides})
    hf_cfg = NemotronHConfig(
        **ours_cfg.to_nemotron_h_kwargs(), layers_block_type=["linear_attention"], vocab_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
    )
    assert Mamba2Config.from_nemotron_h(hf_cfg) == ours_cfg
    hf = randomize_(NemotronHMamba2Mixer(hf_cfg, layer_idx=0), seed, dt_range).eval()
    ours = Mamba2Mixer(Mamba2Config.from_nemotron_h(hf_cfg), layer_idx=0)
    ours.load_state_dict(hf.state_dict(), strict=True)
    NemotronHMamba2Mixer(hf_cfg, layer_idx=0).load_state_dict(ours.state_dict(), strict=True)
    return hf, ours, hf_cfg


def hf_states(cache):
    layer = cache.layers[0]
    return conv_state_from_hf(layer.conv_states[0]), layer.recurrent_states[0]


FP32_TOL = 1e-4  # outputs up to ~10 (measured errors <= 1.2e-5); transformers runs its scans in float32


@needs_hf_torch
@pytest.mark.parametrize("use_bias", [False, True])
def test_matches_transformers_nemotron_h_prefill_and_decode(use_bias):
    from transformers import DynamicCache

    hf, ours, hf_cfg = hf_pair(seed=11, use_bias=use_bias)
    assert ours.conv1d.bias is not None and (ours.in_proj.bias is not None) == use_bias
    g = torch.Generator().manual_seed(4)
    T, n = 13, 5  # T is not a multiple of chunk_size = 8
    u = torch.randn(2, T + n, hf_cfg.hidden_size, generator=g)
    with torch.no_grad():
        # prefill without a cache
        assert maxerr(ours(u)[0], hf(u)) <= FP32_TOL
        # prefill with a cache, then token-by-token decode (HF: chunk path, then its step path)
        cache = DynamicCache(config=hf_cfg)
        y_hf = hf(u[:, :T], cache=cache)
        y_ours, s = ours(u[:, :T])
        assert maxerr(y_ours, y_hf) <= FP32_TOL
        conv_hf, ssm_hf = hf_states(cache)
        assert maxerr(s.conv, conv_hf) <= 1e-6 and maxerr(s.ssm, ssm_hf) <= FP32_TOL
        for i in range(n):
            y_hf = hf(u[:, T + i : T + i + 1], cache=cache)
            y_ours, s = ours.step(u[:, T + i : T + i + 1], s)
            assert maxerr(y_ours, y_hf) <= FP32_TOL
        conv_hf, ssm_hf = hf_states(cache)
        assert maxerr(s.conv, conv_hf) <= 1e-6 and maxerr(s.ssm, ssm_hf) <= FP32_TOL
        # a 4-token window on top of the cache (HF: chunk path with initial_states)
        y_hf = hf(u[:, :4], cache=cache)
        y_ours, s = ours(u[:, :4], s)
        assert maxerr(y_ours, y_hf) <= FP32_TOL
        assert maxerr(s.ssm, hf_states(cache)[1]) <= FP32_TOL


@needs_hf_torch
def test_matches_transformers_with_left_padding():
    hf, ours, hf_cfg = hf_pair(seed=12)
    u = torch.randn(2, 10, hf_cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # row 1 is left-padded by 3
    with torch.no_grad():
        y_ours, s = ours(u, attention_mask=mask)
        assert maxerr(y_ours, hf(u, attention_mask=mask)) <= FP32_TOL
        # the padded row equals the same tokens without padding
        y_unpadded, s1 = ours(u[1:, 3:])
        assert maxerr(y_ours[1, 3:], y_unpadded[0]) <= 1e-5 and maxerr(s.ssm[1], s1.ssm[0]) <= 1e-5


@needs_hf_torch
def test_dt_clamp_ours_equals_transformers_prefill_and_our_decode_equals_our_prefill():
    """dt = softplus(dt_raw + dt_bias) is clamped to `time_step_limit`. transformers' NemotronH mixer (5.25)
    reads that field from its config and applies it in its chunked (prefill) path; its torch step path
    (`mamba2_selective_state_update`) clamps nothing. (Before 5.25 the chunked path clamped at
    time_step_min whatever the field said.) Ours applies the one limit in both paths, so:
    ours == HF prefill for every limit; our decode == our prefill; HF decode == ours unclamped. With dt far
    below 1e-3 on some heads, lightning-mini's limit (1e-3, inf) and the default (0, inf) give different
    outputs, so each agreement is one the clamp could break. Should transformers clamp its step path too,
    only the last assertion's reading changes: HF decode would then equal ours with the limit."""
    from transformers import DynamicCache

    u = torch.randn(1, 12, TINY["hidden_size"], generator=torch.Generator().manual_seed(6))
    T, prefill, hf_decode_gap = 8, {}, []
    for limit in [(1e-3, math.inf), (0.0, math.inf)]:
        hf, ours, hf_cfg = hf_pair(seed=13, time_step_limit=limit)
        with torch.no_grad():
            hf.dt_bias[:3] = -12.0  # softplus(-12 + dt_raw) ~ 1e-5 .. 1e-4: below the (1e-3, inf) clamp
        ours.load_state_dict(hf.state_dict())
        unclamped = Mamba2Mixer(dataclasses.replace(ours.config, time_step_limit=(0.0, math.inf)), layer_idx=0)
        unclamped.load_state_dict(hf.state_dict())
        with torch.no_grad():
            dt, _ = discretize(split_projection(ours.in_proj(u), ours.config)[2], ours.dt_bias, ours.A_log)
            assert (dt[..., :3] < 1e-3).all()
            prefill[limit] = hf(u)  # HF prefill over all 12 tokens
            assert maxerr(ours(u)[0], prefill[limit]) <= FP32_TOL, limit
            cache = DynamicCache(config=hf_cfg)
            hf(u[:, :T], cache=cache)  # HF: prefill 8, then one token at a time
            _, s = ours(u[:, :T])
            s_unclamped = s.clone()
            for i in range(T, 12):
                y_hf = hf(u[:, i : i + 1], cache=cache)
                y_ours, s = ours.step(u[:, i], s)
                y_unclamped, s_unclamped = unclamped.step(u[:, i], s_unclamped)
                assert maxerr(y_ours, prefill[limit][:, i]) <= FP32_TOL, (limit, i)  # our decode == prefill
                assert maxerr(y_unclamped, y_hf[:, 0]) <= FP32_TOL, (limit, i)  # HF decode clamps nothing
                hf_decode_gap.append(maxerr(y_hf[:, 0], prefill[limit][:, i]))
    assert maxerr(prefill[(1e-3, math.inf)], prefill[(0.0, math.inf)]) > 1e-2
    # Under (1e-3, inf), HF's decode parts from HF's prefill far beyond float32 noise; under (0, inf) it does not.
    assert min(hf_decode_gap[:4]) > 10 * FP32_TOL and max(hf_decode_gap[4:]) <= FP32_TOL, hf_decode_gap


# ----------------------------------------------------------------------------------------------------
# (5) poisoned states, (6) bad shapes
# ----------------------------------------------------------------------------------------------------


def test_nan_in_state_is_detected_not_spread():
    mixer = tiny_mixer()
    u = torch.randn(2, 5, TINY["hidden_size"], dtype=F64)
    _, s = mixer(u)
    bad = s.clone()
    bad.ssm[1, 2, 0, 3] = float("nan")
    msg = r"layer 3, incoming state: state\.ssm holds 1 non-finite value\(s\) \(NaN\)"
    with pytest.raises(Mamba2StateError, match=msg):
        mixer.step(u[:, 0], bad)
    with pytest.raises(Mamba2StateError, match=r"\(1, 2, 0, 3\)"):
        mixer(u, bad)
    bad = s.clone()
    bad.conv[0, 0, 0] = float("inf")
    with pytest.raises(Mamba2StateError, match=r"state\.conv .*\(inf\)"):
        check_state(bad, mixer.config, name="layer 3")
    # a NaN in the input is reported in the state it produces, naming the layer
    u_bad = u.clone()
    u_bad[0, 2, 0] = float("nan")
    with pytest.raises(Mamba2StateError, match="layer 3, state produced from this input"):
        mixer(u_bad)
    mixer.check_finite = False  # opt out: then it does spread
    _, s_nan = mixer(u_bad)
    assert torch.isnan(s_nan.ssm[0]).any() and torch.isfinite(s_nan.ssm[1]).all()
    assert check_state(s, mixer.config, batch_size=2) is s


def test_bad_shapes_give_clear_errors():
    mixer = tiny_mixer()
    cfg = mixer.config
    u = torch.randn(2, 5, cfg.hidden_size, dtype=F64)
    with pytest.raises(ValueError, match=r"hidden_states must be \[b, T, 24\]"):
        mixer(u[..., :20])
    with pytest.raises(ValueError, match=r"hidden_state must be \[b, 24\] or \[b, 1, 24\]"):
        mixer.step(u)
    _, s = mixer(u)
    with pytest.raises(Mamba2StateError, match="state batch 2 != input batch 1"):
        mixer(u[:1], s)
    hf_like = Mamba2State(conv=conv_state_to_hf(s.conv), ssm=s.ssm)
    with pytest.raises(Mamba2StateError, match="conv_state_from_hf"):
        mixer.step(u[:, 0], hf_like)
    with pytest.raises(Mamba2StateError, match=r"expected \[b, H, P, N\] = \[b, 6, 4, 8\]"):
        mixer.step(u[:, 0], Mamba2State(conv=s.conv, ssm=s.ssm[:, :, :, :4]))
    with pytest.raises(ValueError, match=r"attention_mask must be \[b, T\]"):
        mixer(u, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="multiple of n_groups"):
        Mamba2Config(**{**TINY, "n_groups": 4})
    with pytest.raises(ValueError, match="positive int"):
        Mamba2Config(**{**TINY, "chunk_size": 0})
    with pytest.raises(ValueError, match="time_step_limit"):
        Mamba2Config(**{**TINY, "time_step_limit": (1.0, 0.1)})
    x, dt, A, B, C, D, h0 = random_ssd_inputs(2, 6, 6, 4, 2, 5, seed=0)
    with pytest.raises(ValueError, match=r"ssd_chunked: B has shape"):
        ssd_chunked(x, dt, A, B[:, :3], C, D, h0, chunk_size=4)
    with pytest.raises(ValueError, match="not a multiple of G = 4"):
        ssd_chunked(x, dt, A, B[..., :1, :].expand(-1, -1, 4, -1), C[..., :1, :].expand(-1, -1, 4, -1), D, h0)
    with pytest.raises(ValueError, match=r"ssd_step: state has shape"):
        ssd_step(h0[:, :, :2], x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ssd_chunked(x, dt, A, B, C, D, h0, chunk_size=0)
    with pytest.raises(ValueError, match="conv_state has shape"):
        causal_conv1d(u, torch.randn(24, 4, dtype=F64), None, torch.zeros(2, 24, 4, dtype=F64))


# ----------------------------------------------------------------------------------------------------
# the rest of the API
# ----------------------------------------------------------------------------------------------------


def test_gated_rms_norm_groups():
    g = torch.Generator().manual_seed(0)
    y, z, w = (torch.randn(*shape, generator=g, dtype=F64) for shape in ((3, 12), (3, 12), (12,)))
    out = gated_rms_norm(y, z, w, group_size=4, eps=0.0)
    gated = y * torch.sigmoid(z) * z
    for k in range(3):  # each group of 4 channels has unit RMS before the weight
        part = gated[:, 4 * k : 4 * k + 4]
        want = part / part.pow(2).mean(-1, keepdim=True).sqrt() * w[4 * k : 4 * k + 4]
        assert maxerr(out[:, 4 * k : 4 * k + 4], want) <= 1e-13


def test_init_state_layout_gradients_and_float32():
    mixer = tiny_mixer(dtype=torch.float32)
    cfg = mixer.config
    s = mixer.init_state(3)
    assert s.conv.shape == (3, cfg.conv_dim, cfg.conv_kernel - 1) and s.ssm.shape == (3, 6, 4, 8)
    assert s.ssm.dtype == torch.float32 and s.nbytes() == 4 * (3 * cfg.conv_dim * 3 + 3 * 6 * 4 * 8)
    assert Mamba2State.zeros(cfg, 1, dtype=torch.bfloat16).ssm.dtype == torch.float32
    u = torch.randn(2, 10, cfg.hidden_size, requires_grad=True)
    y, st = mixer(u)
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mixer.parameters())
    # float32 prefill then steps stays at the float32 level
    with torch.no_grad():
        y_full, _ = mixer(u)
        _, s = mixer(u[:, :6])
        for t in range(6, 10):
            y_t, s = mixer.step(u[:, t], s)
            assert maxerr(y_t, y_full[:, t]) <= 1e-5
    # the default initialisation is the Mamba-2 one: A = -1..-H, D = 1, dt in [time_step_min, time_step_max]
    fresh = Mamba2Mixer(cfg)
    assert torch.allclose(-torch.exp(fresh.A_log), -torch.arange(1.0, 7.0))
    dt0 = F.softplus(fresh.dt_bias)
    assert (dt0 >= cfg.time_step_min * 0.999).all() and (dt0 <= cfg.time_step_max * 1.001).all()
