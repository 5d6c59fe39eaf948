"""Checker of exercise 01x: one verification step of speculative sampling.

    verify_step(drafts: LongTensor[K], p: FloatTensor[K+1, V], q: FloatTensor[K, V],
                generator: torch.Generator) -> list[int]

p[k] is the target's distribution after the prompt and drafts < k, q[k] the drafter's distribution that
drafts[k] was sampled from. The answer is the accepted drafts followed by exactly one more token: the
correction drawn from norm(max(p[k] - q[k], 0)) after the first rejection (at draft k), or the bonus
token drawn from p[K] when every draft was accepted.

The check, in order:
1. exact edge cases: q = p (every draft accepted, then a bonus from p[K]); disjoint supports and a draft
   the target gives probability 0 (the first draft is always rejected, and only the residual can say
   what comes next); q with zeros where p has mass (K = 1; the correction must be able to emit a token
   the drafter never proposes).
2. the generator: two calls with generators seeded alike must return the same tokens.
3. χ² on fixed drafts: over N_FIXED calls, the pair (accepted count, last token) against its exact
   distribution, computed below from min(1, p/q), the residual and p[K].
4. χ² on sampled drafts: drafts drawn from q by the checker, the first emitted token against p[0] (the
   promise of speculative sampling: the output is distributed as the target's).
Each χ² test fails at p-value < ALPHA, so a correct answer that uses the generator in another order
than the solution fails by chance with probability below 2 · ALPHA = 2e-4. The cases are built so that
every mistake listed in MISTAKES moves at least one test far past that threshold at these sample sizes.
When a test fails, the message names the mistake whose exact distribution explains the draws best.
"""
from __future__ import annotations

import operator

import torch

from minispec.exercises.result import Wrong, call

ALPHA = 1e-4  # p-value below which a χ² test fails
N_FIXED = 3000  # calls of the χ² test on fixed drafts
N_SAMPLED = 2000  # calls of the χ² test on drafts sampled from q
SEED = 1234

# (acceptance rule, correction distribution, bonus distribution) -> the mistake it stands for
RIGHT = ("min(1, p/q)", "residual", "p[K]")
MISTAKES = {
    ("min(1, p/q)", "p", "p[K]"):
        "the correction token is drawn from p[k]; after a rejection it must come from the residual "
        "norm(max(p[k] - q[k], 0)), or the tokens the drafter proposes too often are emitted too often",
    ("min(1, p/q)", "q - p", "p[K]"):
        "the residual is reversed: after a rejection draw from norm(max(p[k] - q[k], 0)), not from max(q - p, 0)",
    ("min(1, p/q)", "q", "p[K]"):
        "the correction token is drawn from q[k]; it must come from the residual norm(max(p[k] - q[k], 0))",
    ("p >= q", "residual", "p[K]"):
        "acceptance is deterministic (accept iff p >= q): accept draft k with probability "
        "min(1, p[k, x] / q[k, x]), i.e. iff u < p[k, x] / q[k, x] for a uniform u drawn from the generator",
    ("p", "residual", "p[K]"):
        "a draft is accepted with probability p[k, x]; the rule is min(1, p[k, x] / q[k, x])",
    ("min(1, q/p)", "residual", "p[K]"):
        "the acceptance ratio is upside down: accept with probability min(1, p/q), not min(1, q/p)",
    ("min(1, p/q)", "residual", "p[K-1]"):
        "the bonus token is drawn from p[K-1]; after all K drafts are accepted it comes from p[K], the "
        "target's distribution after the last draft",
}


def outcome_probs(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, rule: tuple = RIGHT) -> torch.Tensor:
    """[K+1, V] float64: P(exactly a drafts accepted, then token t) for a = 0..K, under `rule`.

    P(a = j, t) = prod_{k<j} alpha_k · (1 - alpha_j) · r_j(t) for j < K, and prod_k alpha_k · p_K(t) for j = K.
    """
    accept, correction, bonus = rule
    p, q = p.double(), q.double()
    K = drafts.shape[0]
    k = torch.arange(K)
    px, qx = p[k, drafts], q[k, drafts]
    alpha = {"min(1, p/q)": (px / qx).clamp(max=1),
             "p >= q": (px >= qx).double(),
             "p": px,
             "min(1, q/p)": torch.where(px > 0, qx / px, 1.0).clamp(max=1)}[accept]
    reach = torch.cat([torch.ones(1, dtype=torch.float64), alpha.cumprod(0)])  # P(drafts < j all accepted)
    rows = []
    for j in range(K):
        dist = {"residual": (p[j] - q[j]).clamp(min=0), "p": p[j], "q - p": (q[j] - p[j]).clamp(min=0),
                "q": q[j]}[correction]
        dist = dist / dist.sum() if dist.sum() > 0 else p[j]
        rows.append(reach[j] * (1 - alpha[j]) * dist)
    rows.append(reach[K] * {"p[K]": p[K], "p[K-1]": p[K - 1]}[bonus])
    return torch.stack(rows)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's χ² goodness of fit of `counts` to `probs` (both 1-D). Bins expected below 5 draws are
    pooled; outcomes of probability 0 must be handled before (they are impossible, not unlikely)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big].tolist(), expected[big].tolist()
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_exp >= 5 or (rest_exp > 0 and not obs):
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 0:
        obs[-1] += rest_obs
        exp[-1] += rest_exp
    if len(obs) < 2:
        return 1.0
    obs_t, exp_t = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = ((obs_t - exp_t) ** 2 / exp_t).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), stat / 2))


def run(fn, drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> list[int]:
    """The learner's answer for one step, checked for form: a list of ints, accepted drafts then one token."""
    out = call(fn, drafts.clone(), p.clone(), q.clone(), generator)
    if isinstance(out, torch.Tensor):
        out = out.flatten().tolist()
    if not isinstance(out, (list, tuple)):
        raise Wrong(f"verify_step must return a list of token ids, got {type(out).__name__}")
    try:
        out = [operator.index(t) for t in out]
    except TypeError:
        raise Wrong(f"verify_step must return a list of int token ids, got {out!r}") from None
    K = drafts.shape[0]
    if not out:
        raise Wrong("verify_step returned an empty list: every step emits at least one token (the correction "
                    "after a rejection, or the bonus token after K acceptances)")
    if len(out) > K + 1:
        raise Wrong(f"verify_step returned {len(out)} tokens for K = {K} drafts; at most K accepted drafts + one "
                    "more. Did you continue after a rejection, or add a token after every draft?")
    x = drafts.tolist()
    for i, t in enumerate(out[:-1]):
        if t != x[i]:
            raise Wrong(f"token {i} of your answer is {t}, but drafts[{i}] = {x[i]}: the answer must be the accepted "
                        "drafts (a prefix of drafts), then exactly one token. A rejected draft ends the step: did "
                        "you continue after the first rejection?")
    return out


def _edge_cases(fn) -> None:
    g = torch.Generator().manual_seed(SEED)
    # q = p: min(1, p/q) = 1 for every draft, so all K are accepted, then a bonus from p[K].
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0, 0.0], [0.25, 0.25, 0.0, 0.5, 0.0, 0.0],
                      [0.0, 0.6, 0.4, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.7, 0.3]])
    drafts = torch.tensor([3, 0, 2])
    for _ in range(10):
        try:
            out = run(fn, drafts, p, p[:3], g)
        except Wrong as e:
            raise Wrong(f"{e}\nThis was the case q = p, where every draft must be accepted (min(1, p/q) = 1); a "
                        "rejection there leaves a residual max(p - q, 0) with no mass to sample from.") from None
        if out == drafts.tolist():
            raise Wrong("no bonus token: with q = p every draft is accepted, and the step must then emit one more "
                        "token drawn from p[K] (you returned only the K drafts)")
        if len(out) < 4:
            raise Wrong(f"with q = p every draft must be accepted (min(1, p/q) = 1), but your answer {out} rejected "
                        f"draft {len(out) - 1}")
        if p[3, out[3]] == 0:
            raise Wrong(f"with q = p all drafts were accepted and the bonus token was {out[3]}, which p[K] gives "
                        "probability 0: draw the bonus from p[K], the target's distribution after the last draft")
    # Disjoint supports, and a first draft the target gives probability 0: always rejected, and the residual
    # max(p - q, 0) is then p itself.
    p = torch.tensor([[0.0, 0.0, 0.0, 0.5, 0.3, 0.2], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [1 / 6] * 6])
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    for _ in range(10):
        out = run(fn, torch.tensor([1, 2]), p, q, g)
        if out[0] == 1 and len(out) > 1:
            raise Wrong(f"your answer {out} accepted drafts[0] = 1, which the target gives probability p[0, 1] = 0: "
                        "accept with probability min(1, p/q), which is 0 there")
        if len(out) > 1:
            raise Wrong(f"drafts[0] = 1 has p[0, 1] = 0, so it is always rejected and the step ends with one "
                        f"correction token; your answer {out} continued after the rejection")
        if p[0, out[0]] == 0:
            hint = (" That token is where q has mass: the residual is max(p - q, 0), not max(q - p, 0), nor q."
                    if q[0, out[0]] > 0 else "")
            raise Wrong(f"after rejecting drafts[0] your correction token {out[0]} has probability 0 under p[0] "
                        f"(p and q have disjoint supports here, so the residual is p[0] itself).{hint}")
    # q with zeros where p has mass, K = 1. Draft 1 (p/q = 2.5) is always accepted; draft 2 (p = 0) always
    # rejected, and then token 0, which q never proposes, has residual mass 0.5 / 0.8.
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 0.2, 0.8, 0.0]])
    for _ in range(10):
        out = run(fn, torch.tensor([1]), p, q, g)
        if out != [1, 3]:
            raise Wrong(f"K = 1, draft 1 with p = 0.5 > q = 0.2 must always be accepted (min(1, p/q) = 1), then the "
                        f"bonus from p[1] = one-hot(3): expected [1, 3], got {out}")
    corrections = [run(fn, torch.tensor([2]), p, q, g) for _ in range(30)]
    if any(len(out) != 1 for out in corrections):
        raise Wrong("K = 1, draft 2 has p = 0 and must always be rejected, leaving one correction token; got "
                    f"{next(o for o in corrections if len(o) != 1)}")
    firsts = {out[0] for out in corrections}
    if not firsts <= {0, 1}:
        raise Wrong(f"after rejecting a draft with p = 0 your correction was {sorted(firsts - {0, 1})}, a token p "
                    "gives probability 0: draw it from norm(max(p - q, 0))")
    if 0 not in firsts:
        raise Wrong("where q is 0 and p is not (token 0 here), only the correction can emit the token: in 30 "
                    "rejections your answer never emitted token 0, which the residual norm(max(p - q, 0)) gives "
                    "probability 0.625")


def _generator_is_used(fn) -> None:
    p = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2], [0.3, 0.3, 0.4]])
    q = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    drafts = torch.tensor([0, 2])
    first = [run(fn, drafts, p, q, torch.Generator().manual_seed(s)) for s in range(20)]
    again = [run(fn, drafts, p, q, torch.Generator().manual_seed(s)) for s in range(20)]
    if first != again:
        raise Wrong("two calls with generators seeded alike returned different tokens: draw every random number "
                    "from the `generator` argument (torch.rand(..., generator=generator), "
                    "torch.multinomial(..., generator=generator))")
    if len({tuple(o) for o in first}) == 1:
        raise Wrong(f"20 calls with different seeds all returned {first[0]}, but this step is random: draft 0 has "
                    "p = 0.2, q = 0.5 and is accepted with probability min(1, p/q) = 0.4. Acceptance looks "
                    "deterministic: draw u from the generator and accept iff u < p[k, x] / q[k, x]")


# Fixed drafts for the χ² test: draft 0 is accepted with probability 0.25, draft 1 with 0.6; the residuals,
# p, q, p[1] and p[2] all differ, so each mistake in MISTAKES shifts the outcome distribution.
FIXED_P = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0], [0.3, 0.3, 0.2, 0.1, 0.1], [0.05, 0.05, 0.1, 0.2, 0.6]])
FIXED_Q = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0], [0.1, 0.5, 0.1, 0.2, 0.1]])
FIXED_DRAFTS = torch.tensor([0, 1])
# Drafts sampled from q for the test of the first token's marginal.
SAMPLED_P = torch.tensor([[0.05, 0.15, 0.3, 0.5], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]])
SAMPLED_Q = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])


def _diagnose(counts: torch.Tensor) -> str | None:
    """The mistake whose exact outcome distribution makes `counts` [K+1, V] most likely, if it beats the right one."""
    def loglik(rule):
        return float((counts * outcome_probs(FIXED_DRAFTS, FIXED_P, FIXED_Q, rule).clamp(min=1e-12).log()).sum())
    best = max([RIGHT, *MISTAKES], key=loglik)
    return None if best == RIGHT else MISTAKES[best]


def _fixed_drafts_test(fn) -> float:
    g = torch.Generator().manual_seed(SEED)
    K = FIXED_DRAFTS.shape[0]
    counts = torch.zeros(K + 1, FIXED_P.shape[1])
    for _ in range(N_FIXED):
        out = run(fn, FIXED_DRAFTS, FIXED_P, FIXED_Q, g)
        counts[len(out) - 1, out[-1]] += 1
    exact = outcome_probs(FIXED_DRAFTS, FIXED_P, FIXED_Q)
    impossible = (exact == 0) & (counts > 0)
    pvalue = 0.0 if impossible.any() else chi_square_pvalue(counts, exact)
    if pvalue >= ALPHA:
        return pvalue
    accepted = counts.sum(1) / N_FIXED
    expected = exact.sum(1)
    table = ", ".join(f"{a}: {accepted[a]:.3f} (exact {expected[a]:.3f})" for a in range(K + 1))
    mistake = _diagnose(counts)
    if impossible.any():
        a, t = impossible.nonzero()[0].tolist()
        what = (f"after accepting {a} draft(s) you emitted token {t}, which is impossible there" if a < K
                else f"after accepting every draft you emitted bonus token {t}, which p[K] gives probability 0")
    else:
        what = f"the outcomes do not follow the exact distribution (χ² p-value {pvalue:.1e} < {ALPHA:g})"
    likely = f"Likely mistake: {mistake}." if mistake else (
        "The share of steps by accepted count looks wrong: check the acceptance rule min(1, p/q) and that each "
        "draft is tested only if all before it were accepted." if chi_square_pvalue(counts.sum(1), expected) < ALPHA
        else "The accepted counts are right but the last token is not: check the correction (residual "
             "norm(max(p - q, 0)) at the rejected position) and the bonus (p[K]).")
    raise Wrong(f"On {N_FIXED} steps with drafts {FIXED_DRAFTS.tolist()}, {what}.\nShare of steps by number of "
                f"accepted drafts: {table}.\n{likely}")


def _sampled_drafts_test(fn) -> float:
    g = torch.Generator().manual_seed(SEED + 1)
    counts = torch.zeros(SAMPLED_P.shape[1])
    for _ in range(N_SAMPLED):
        drafts = torch.multinomial(SAMPLED_Q, 1, generator=g).flatten()
        out = run(fn, drafts, SAMPLED_P, SAMPLED_Q, g)
        counts[out[0]] += 1
    pvalue = chi_square_pvalue(counts, SAMPLED_P[0])
    if pvalue < ALPHA:
        got = ", ".join(f"{c / N_SAMPLED:.3f}" for c in counts.tolist())
        raise Wrong(f"with drafts sampled from q, the first emitted token must be distributed exactly as p[0] = "
                    f"{SAMPLED_P[0].tolist()}; over {N_SAMPLED} steps yours came out as [{got}] "
                    f"(χ² p-value {pvalue:.1e} < {ALPHA:g})")
    return pvalue


def check_verify_step(fn) -> str:
    _edge_cases(fn)
    _generator_is_used(fn)
    p_fixed = _fixed_drafts_test(fn)
    p_sampled = _sampled_drafts_test(fn)
    return (f"Exact on the edge cases (q = p, disjoint supports, p = 0 drafts, q with zeros where p has mass, "
            f"K = 1). On {N_FIXED} steps with fixed drafts, the accepted counts and emitted tokens follow the exact "
            f"distribution (χ² p-value {p_fixed:.2f}); on {N_SAMPLED} steps with drafts sampled from q, the first "
            f"token is distributed as p[0] (p-value {p_sampled:.2f}). A correct answer fails these χ² tests by "
            f"chance with probability below {2 * ALPHA:g}.")
