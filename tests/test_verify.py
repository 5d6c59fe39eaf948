"""Exact speculative verification: the kernel equals the reference, greedy and ragged semantics, input
errors, and losslessness tested statistically (chi-square goodness of fit against the target)."""
import pytest
import torch
import torch.nn.functional as F

from minispec.speculative.sampling import sampling_probs
from minispec.speculative.verify import VerifyResult, acceptance_probability, draw_uniforms, inverse_cdf, verify

IMPLS = {"reference": verify.reference, "kernel": verify.kernel}
CUDA = torch.cuda.is_available()
# The kernel runs on CUDA tensors where there is a GPU, under the interpreter on CPU otherwise.
KERNEL_DEVICE = "cuda" if CUDA else "cpu"


def random_block(B, K, V, seed, one_hot_q=False, ragged=False, device="cpu"):
    """Drafts with p and q that are related (q is p's logits plus noise), so acceptance varies.

    Returns the arguments of `verify`: drafts [B, K], p [B, K+1, V], q [B, K, V] or None,
    uniforms [B, K+1], draft_lengths [B] or None. With ragged rows the unused draft slots hold -1.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    logits = 4 * torch.randn(B, K + 1, V, generator=g, device=device)
    p = logits.softmax(dim=-1)
    q = (logits[:, :K] + torch.randn(B, K, V, generator=g, device=device)).softmax(dim=-1)
    if one_hot_q:
        drafts, q = q.argmax(dim=-1), None
    else:
        drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
    lengths = None
    if ragged:
        lengths = torch.randint(1, K + 1, (B,), generator=g, device=device)
        drafts = drafts.masked_fill(torch.arange(K, device=device) >= lengths[:, None], -1)
    return drafts, p, q, draw_uniforms(B, K, g, device), lengths


def run(impl, *args, **kwargs):
    """Call the reference on CPU, or the kernel on KERNEL_DEVICE; None and ints pass through."""
    dev = KERNEL_DEVICE if impl == "kernel" else "cpu"
    def to(t):
        return t.to(dev) if isinstance(t, torch.Tensor) else t
    return IMPLS[impl](*map(to, args), **{k: to(v) for k, v in kwargs.items()})


def assert_same(a: VerifyResult, b: VerifyResult):
    for name in ("accepted", "tokens", "num_emitted", "next_is_bonus"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name


# --- the kernel equals the reference ------------------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "ragged+eos"])
@pytest.mark.parametrize("one_hot_q", [False, True], ids=["sampled_q", "one_hot_q"])
@pytest.mark.parametrize("K", [1, 4, 7])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_kernel_equals_reference(B, K, one_hot_q, variant):
    # V = 3001 spans two BLOCK_V chunks and is no multiple of the chunk width.
    drafts, p, q, u, lengths = random_block(B, K, 3001, seed=100 * B + 10 * K + one_hot_q,
                                            one_hot_q=one_hot_q, ragged=variant != "plain")
    eos = int(drafts[0, 0]) if variant != "plain" else None  # an EOS that some row does draft
    assert_same(run("reference", drafts, p, q, u, lengths, eos), run("kernel", drafts, p, q, u, lengths, eos))


def test_kernel_equals_reference_across_outcomes():
    """One batch that holds every outcome at once: rejections at each position, bonus tokens,
    ragged rows, an EOS, and a vocabulary smaller than one chunk."""
    drafts, p, q, u, lengths = random_block(64, 4, 7, seed=3, ragged=True)
    eos = 2
    want = verify.reference(drafts, p, q, u, lengths, eos)
    assert len(set(want.accepted.tolist())) == 5  # accepted counts 0..4 all occur
    assert want.next_is_bonus.any() and (~want.next_is_bonus).any()
    assert (want.num_emitted < want.accepted + 1).any()  # some row was cut at EOS
    assert_same(want, run("kernel", drafts, p, q, u, lengths, eos))


@pytest.mark.parametrize("impl", IMPLS)
def test_extreme_uniforms_never_pick_a_zero_mass_token(impl):
    """The smallest u picks the first token with mass, u = 1 the last one: never one of the zero-mass
    tokens around them. In the kernel u = 1 also meets the rounding guard of its chunked scan."""
    p = torch.tensor([0.0, 0.0, 0.2, 0.0, 0.5, 0.3, 0.0]).expand(4, 2, 7)
    drafts = torch.tensor([[4], [5], [5], [4]])  # one-hot q
    tiny = 2.0**-24  # the smallest 1 - torch.rand can give
    u = torch.tensor([[tiny, 1.0], [1.0, tiny], [1.0, 1.0], [tiny, tiny]])
    # Rows 0 and 3 accept draft 4 and draw the bonus from p; rows 1 and 2 reject draft 5
    # (1.0 * q = 1 > 0.3) and draw from the residual p - one_hot(5) = {2: 0.2, 4: 0.5}.
    res = run(impl, drafts, p, None, u)
    assert res.tokens.tolist() == [[4, 5], [2, -1], [4, -1], [4, 2]]


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_residual_falls_back_to_p(impl):
    """p = 0.9995 q sums to 1 within tolerance, and p < q everywhere: max(p - q, 0) has no mass at
    all. The documented choice is to draw the correction from p."""
    q = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]])
    p = torch.cat([q * 0.9995, torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])], dim=1)  # [1, 2, 4]
    drafts, u = torch.tensor([[3]]), torch.tensor([[1.0, 0.5]])  # u = 1: 0.4 > 0.9995 * 0.4, rejected
    res = run(impl, drafts, p, q, u)
    assert res.accepted.item() == 0
    assert res.tokens.cpu().tolist() == [[inverse_cdf(p[:, 0], torch.tensor([0.5])).item(), -1]]


@pytest.mark.gpu
@pytest.mark.parametrize("one_hot_q", [False, True], ids=["sampled_q", "one_hot_q"])
def test_kernel_equals_reference_full_vocab_gpu(one_hot_q):
    drafts, p, q, u, lengths = random_block(64, 7, 262_144, seed=7, one_hot_q=one_hot_q, ragged=True,
                                            device="cuda")
    want = verify.reference(drafts, p, q, u, lengths, eos_token_id=0)
    got = verify.kernel(drafts, p, q, u, lengths, eos_token_id=0)
    assert_same(want, got)


# --- semantics: greedy, ragged, EOS -------------------------------------------------------------

def greedy_block(target_argmax, drafts, V=10):
    """One-hot p (temperature 0 upstream) at the given argmaxes: [B, K+1] -> [B, K+1, V]."""
    logits = F.one_hot(torch.tensor(target_argmax), V).float()
    return torch.tensor(drafts), sampling_probs(logits, temperature=0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_accepts_the_matching_prefix_then_emits_the_argmax(impl):
    # Target argmax at positions 0..3, and the drafts: row 0 matches all, row 1 breaks at 1, row 2 at 0.
    drafts, p = greedy_block([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]],
                             [[1, 2, 3], [1, 9, 3], [7, 2, 3]])
    for seed in range(3):  # any uniforms give the same answer: u <= 1 = p(argmax)
        res = run(impl, drafts, p, None, draw_uniforms(3, 3, torch.Generator().manual_seed(seed), "cpu"))
        assert res.accepted.tolist() == [3, 1, 0]
        assert res.tokens.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [1, -1, -1, -1]]
        assert res.num_emitted.tolist() == [4, 2, 1]
        assert res.next_is_bonus.tolist() == [True, False, False]


@pytest.mark.parametrize("impl", IMPLS)
def test_ragged_rows_take_their_bonus_at_their_own_length(impl):
    drafts, p = greedy_block([[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 4]],
                             [[1, 2, 3], [1, 2, -1], [1, 8, -1]])  # -1: padding past K_b
    res = run(impl, drafts, p, None, draft_lengths=torch.tensor([3, 2, 2]))
    assert res.accepted.tolist() == [3, 2, 1]
    assert res.tokens.tolist() == [[1, 2, 3, 4], [1, 2, 5, -1], [1, 2, -1, -1]]  # row 1: bonus from p_2
    assert res.next_is_bonus.tolist() == [True, True, False]


@pytest.mark.parametrize("impl", IMPLS)
def test_eos_cuts_num_emitted_but_not_tokens(impl):
    EOS = 0
    drafts, p = greedy_block([[5, 0, 7, 8], [5, 6, 0, 8], [5, 6, 7, 8]],
                             [[5, 0, 7], [5, 6, 9], [5, 6, 7]])
    res = run(impl, drafts, p, None, eos_token_id=EOS)
    assert res.accepted.tolist() == [3, 2, 3]
    assert res.tokens.tolist() == [[5, 0, 7, 8], [5, 6, 0, -1], [5, 6, 7, 8]]
    assert res.num_emitted.tolist() == [2, 3, 4]  # accepted EOS; EOS as the correction; no EOS


def test_generator_draws_the_uniforms_it_is_given():
    drafts, p, q, _, _ = random_block(16, 4, 50, seed=1)
    u = draw_uniforms(16, 4, torch.Generator().manual_seed(5), "cpu")
    assert u.min() > 0 and u.max() <= 1
    assert_same(verify(drafts, p, q, generator=torch.Generator().manual_seed(5)), verify(drafts, p, q, u))


def test_acceptance_probability_is_one_minus_total_variation():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    tv = 0.5 * (p - q).abs().sum()
    assert acceptance_probability(p, q).item() == pytest.approx(1 - tv.item())


# --- bad input ----------------------------------------------------------------------------------

def bad_inputs():
    """(name, change to a valid (drafts, p, q, u, lengths), error pattern)."""
    def set_(i, index, value):
        def change(args):
            args[i] = args[i].clone()
            args[i][index] = value
        return change

    def replace(i, make):
        def change(args):
            args[i] = make(args[i])
        return change

    return [
        ("empty drafts", replace(0, lambda d: d[:, :0]), "empty drafts"),
        ("float draft ids", replace(0, lambda d: d.float()), "integer token ids"),
        ("batch mismatch", replace(1, lambda p: p[:2]), "batch size mismatch"),
        ("p not K+1 long", replace(1, lambda p: p[:, :3]), r"K\+1 = 4 positions"),
        ("vocab mismatch", replace(2, lambda q: F.pad(q, (0, 1))), "vocab mismatch"),
        ("q negative", set_(2, (0, 0, 0), -0.1), "draft_probs is not a distribution: it has negative"),
        ("p sums to 1/2", replace(1, lambda p: p / 2), "target_probs is not a distribution: a row sums"),
        ("NaN in p", set_(1, (1, 2, 3), float("nan")), "target_probs contains NaN"),
        ("NaN in q", set_(2, (1, 2, 3), float("nan")), "draft_probs contains NaN"),
        ("NaN in u", set_(3, (0, 0), float("nan")), "uniforms contain NaN"),
        ("draft id >= V", set_(0, (2, 1), 12), r"draft token ids must lie in \[0, V\)"),
        ("draft id < 0", set_(0, (2, 1), -1), r"draft token ids must lie in \[0, V\)"),
        ("length 0", set_(4, 1, 0), r"draft_lengths must lie in \[1, K\]"),
        ("length > K", set_(4, 1, 4), r"draft_lengths must lie in \[1, K\]"),
        ("u = 0", set_(3, (0, 3), 0.0), r"uniforms must lie in \(0, 1\]"),
        ("u > 1", set_(3, (2, 0), 1.5), r"uniforms must lie in \(0, 1\]"),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name,change,match", bad_inputs(), ids=[c[0] for c in bad_inputs()])
def test_bad_input_raises(impl, name, change, match):
    drafts, p, q, u, _ = random_block(3, 3, 12, seed=0)
    args = [drafts, p, q, u, torch.full((3,), 3)]
    change(args)
    with pytest.raises(ValueError, match=match):
        run(impl, *args)


@pytest.mark.parametrize("impl", IMPLS)
def test_unused_slots_of_ragged_rows_are_not_checked(impl):
    drafts, p, q, u, _ = random_block(2, 3, 12, seed=0)
    lengths = torch.tensor([3, 1])
    drafts[1, 1:] = -1
    q[1, 1:] = float("nan")
    u[1, 1:3] = 0.0  # column 3 (the correction / bonus) is still used
    p[1, 3] = 0.0
    assert_same(run(impl, drafts, p, q, u, lengths), verify.reference(drafts, p, q.nan_to_num(), u, lengths))


# --- losslessness, statistically ----------------------------------------------------------------
#
# A toy order-1 language model over V = 6 tokens: row c of a [V+1, V] table is the distribution of
# the next token after token c (row V is the start). The target has P, the drafter Q, both from
# `sampling_probs` with the same temperature / top-k / top-p. We run the full speculative loop on
# N = 40,000 independent sequences in one batch until each has emitted 3 tokens. Exactness says the
# first token is distributed as P[start], and the first three as P[start, t0] P[t0, t1] P[t1, t2].
# Chi-square goodness of fit: the correct verifier must give p-value > 1e-3 (fixed seeds, so the
# test is deterministic), and a verifier with one classic bug must give p-value < 1e-9.

V_TOY, N_SEQ, K_TOY, N_TOKENS = 6, 40_000, 2, 3
ALPHA_PASS, ALPHA_BROKEN = 1e-3, 1e-9

SETTINGS = {  # name: (temperature, top_k, top_p, one-hot q)
    "sampled_q": (1.0, None, None, False),
    "one_hot_q": (1.0, None, None, True),
    "sampled_q_top_k": (0.8, 3, None, False),
    "sampled_q_top_p": (1.2, None, 0.8, False),
    "one_hot_q_top_k_top_p": (1.0, 4, 0.9, True),
}


def toy_tables(temperature, top_k, top_p, seed=0):
    g = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(V_TOY + 1, V_TOY, generator=g)
    draft_logits = target_logits + torch.randn(V_TOY + 1, V_TOY, generator=g)
    return (sampling_probs(target_logits, temperature, top_k, top_p),
            sampling_probs(draft_logits, temperature, top_k, top_p))


def speculate(verify_fn, P, Q, one_hot_q, seed, device="cpu"):
    """The speculative loop on the toy model: [N_SEQ, N_TOKENS] first emitted tokens per sequence."""
    P, Q = P.to(device), Q.to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.full((N_SEQ, N_TOKENS + K_TOY + 1), -1, device=device)
    n = torch.zeros(N_SEQ, dtype=torch.long, device=device)
    last = torch.full((N_SEQ,), V_TOY, device=device)  # the start "token"
    rows = torch.arange(N_SEQ, device=device)[:, None]
    while (n < N_TOKENS).any():
        context = [last]  # the token before each position: p_k = P[context[k]]
        for _ in range(K_TOY):
            q_k = Q[context[-1]]
            context.append(q_k.argmax(-1) if one_hot_q else torch.multinomial(q_k, 1, generator=g)[:, 0])
        context = torch.stack(context, dim=1)  # [N, K+1]
        drafts, p = context[:, 1:], P[context]
        q = None if one_hot_q else Q[context[:, :-1]]
        res = verify_fn(drafts, p, q, generator=g)
        slot = n[:, None] + torch.arange(K_TOY + 1, device=device)
        keep = (torch.arange(K_TOY + 1, device=device) < res.num_emitted[:, None]) & (n < N_TOKENS)[:, None]
        out[rows.expand_as(slot)[keep], slot[keep]] = res.tokens[keep]
        n += torch.where(n < N_TOKENS, res.num_emitted, 0)
        last = res.tokens.gather(1, res.accepted[:, None])[:, 0]
    return out[:, :N_TOKENS].cpu()


def chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's goodness of fit. Cells of zero probability must stay empty (exactness, not
    statistics); cells expecting fewer than 5 counts are pooled into one, as the chi-square
    approximation needs. p-value = P(chi2_dof > stat) = Q(dof/2, stat/2), the regularised upper
    incomplete gamma function."""
    observed, expected_probs = observed.double().flatten(), expected_probs.double().flatten()
    assert observed[expected_probs == 0].sum() == 0, "a token of target probability 0 was emitted"
    expected = expected_probs * observed.sum()
    keep, pool = expected >= 5, (expected > 0) & (expected < 5)
    obs, exp = observed[keep], expected[keep]
    if pool.any():
        obs = torch.cat([obs, observed[pool].sum()[None]])
        exp = torch.cat([exp, expected[pool].sum()[None]])
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor(len(obs) - 1, dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, stat / 2).item()


def lossless_p_values(verify_fn, setting, seed=1, device="cpu"):
    """(p-value of the first token, p-value of the first 3 tokens jointly)."""
    temperature, top_k, top_p, one_hot_q = SETTINGS[setting]
    P, Q = toy_tables(temperature, top_k, top_p)
    t = speculate(verify_fn, P, Q, one_hot_q, seed, device)
    first = P[V_TOY]
    block = first[:, None, None] * P[:V_TOY][:, :, None] * P[:V_TOY][None, :, :]  # P(t0) P(t1|t0) P(t2|t1)
    block_ids = (t[:, 0] * V_TOY + t[:, 1]) * V_TOY + t[:, 2]
    return (chi_square_p_value(torch.bincount(t[:, 0], minlength=V_TOY), first),
            chi_square_p_value(torch.bincount(block_ids, minlength=V_TOY**3), block))


@pytest.mark.parametrize("setting", SETTINGS)
def test_output_has_the_target_distribution(setting):
    first, block = lossless_p_values(verify, setting)
    assert first > ALPHA_PASS and block > ALPHA_PASS, (first, block)


def broken_verify(flaw: str):
    """A verifier with one classic bug, otherwise like the reference (uniforms from `generator`)."""
    def verify_fn(drafts, p, q, generator=None):
        B, K = drafts.shape
        q = F.one_hot(drafts, p.shape[-1]).float() if q is None else q
        u = draw_uniforms(B, K, generator, drafts.device)
        p_x, q_x = (t.gather(-1, drafts[..., None])[..., 0] for t in (p[:, :K], q))
        if flaw == "accept_min_1_q_over_p":
            accept = u[:, :K] * p_x <= q_x
        else:
            accept = u[:, :K] * q_x <= p_x
        accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
        rows, bonus = torch.arange(B), accepted == K
        p_next, q_next = p[rows, accepted], q[rows, accepted.clamp(max=K - 1)] * (~bonus)[:, None]
        dist = p_next if flaw == "residual_from_p" else (p_next - q_next).clamp(min=0)
        tokens = F.pad(torch.where(torch.arange(K) < accepted[:, None], drafts, -1), (0, 1), value=-1)
        tokens[rows, accepted] = torch.multinomial(dist, 1, generator=generator)[:, 0]
        return VerifyResult(accepted, tokens, accepted + 1, bonus)
    return verify_fn


@pytest.mark.parametrize("flaw", ["residual_from_p", "accept_min_1_q_over_p"])
def test_broken_verifier_fails_the_same_test(flaw):
    first, block = lossless_p_values(broken_verify(flaw), "sampled_q")
    assert first < ALPHA_BROKEN and block < ALPHA_BROKEN, (first, block)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["sampled_q", "one_hot_q_top_k_top_p"])
def test_kernel_output_has_the_target_distribution_gpu(setting):
    first, block = lossless_p_values(verify.kernel, setting, device="cuda")
    assert first > ALPHA_PASS and block > ALPHA_PASS, (first, block)


@pytest.mark.parametrize("setting", ["sampled_q", "one_hot_q", "sampled_q_top_p"])
def test_acceptance_rate_is_sum_of_min_p_q(setting):
    """One draft per sequence from the start row: P(accept) = sum min(p, q) = 1 - TV(p, q).
    N = 200,000 draws; |z| < 4 standard errors of a binomial proportion."""
    temperature, top_k, top_p, one_hot_q = SETTINGS[setting]
    P, Q = toy_tables(temperature, top_k, top_p)
    p, q, N = P[V_TOY], Q[V_TOY], 200_000
    g = torch.Generator().manual_seed(2)
    if one_hot_q:
        q = F.one_hot(q.argmax(), V_TOY).float()  # the argmax draft, always the same token
    drafts = torch.multinomial(q, N, replacement=True, generator=g)[:, None]
    res = verify(drafts, p.expand(N, 2, -1), None if one_hot_q else q.expand(N, 1, -1), generator=g)
    alpha = acceptance_probability(p, q).item()
    z = (res.accepted.double().mean().item() - alpha) / (alpha * (1 - alpha) / N) ** 0.5
    assert abs(z) < 4, (alpha, z)
