"""Checkers of exercise 03x: the recursive drafting loop of an MTP head, and the boosting loss (below).

    mtp_draft(head, embed, lm_head, hidden: FloatTensor[H], token: int, K: int) -> list[int]

`hidden` is the backbone's last hidden state, `token` the token sampled after it. Depth 1 calls
head(hidden, embed(token)) -> out [H]; its draft is argmax(lm_head(out)). Depth k reads the head's own
output of depth k - 1 and the embedding of draft k - 1. K calls of the same head give K greedy drafts.

The checker hands in a small random head and records every call, so a wrong answer is explained by the
first call whose inputs are not the ones the recursion prescribes.
"""
from __future__ import annotations

import operator

import torch

from minispec.exercises.result import Wrong, as_tensor, call

H, V = 16, 12


class ToyHead:
    """head(hidden [H], e [H]) -> out [H]: tanh(W_h hidden + W_e e), with every call recorded."""

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.W_h, self.W_e = torch.randn(H, H, generator=g) / H**0.5, torch.randn(H, H, generator=g) / H**0.5
        self.table = torch.randn(V, H, generator=g)
        self.W_out = torch.randn(V, H, generator=g)
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def head(self, hidden: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.W_h @ hidden.reshape(H) + self.W_e @ e.reshape(H))
        self.calls.append((hidden.reshape(H).clone(), e.reshape(H).clone(), out.clone()))
        return out

    def embed(self, token) -> torch.Tensor:
        return self.table[int(token)]

    def lm_head(self, out: torch.Tensor) -> torch.Tensor:
        return self.W_out @ out.reshape(H)

    def expected(self, hidden: torch.Tensor, token: int, K: int) -> list[int]:
        drafts = []
        for _ in range(K):
            hidden = torch.tanh(self.W_h @ hidden + self.W_e @ self.table[token])
            token = int((self.W_out @ hidden).argmax())
            drafts.append(token)
        return drafts

    def which_token(self, e: torch.Tensor) -> int | None:
        match = (self.table - e).abs().amax(dim=1) < 1e-6
        return int(match.nonzero()[0]) if match.any() else None


def _explain(toy: ToyHead, hidden: torch.Tensor, token: int, K: int, drafts: list[int]) -> str:
    calls = toy.calls
    if len(calls) != K:
        return (f"the head was called {len(calls)} times for K = {K} drafts: call it once per draft (depth), "
                "K times in all")
    prev_out, prev_token = hidden, token
    for depth, (h_in, e_in, out) in enumerate(calls, start=1):
        if not torch.allclose(h_in, prev_out, atol=1e-6):
            if depth > 1 and torch.allclose(h_in, hidden, atol=1e-6):
                return (f"depth {depth} read the backbone's hidden state again: depth k must read the head's own "
                        "output of depth k - 1 (that is the recursion; it stands in for the backbone's next state)")
            return (f"depth {depth} read a hidden state that is neither the backbone's (depth 1) nor the head's "
                    "output of the previous depth")
        t = toy.which_token(e_in)
        if t != prev_token:
            if depth > 1 and t == token:
                return (f"depth {depth} read the embedding of the original `token` again: depth k reads the "
                        "embedding of draft k - 1, the token it is predicting after")
            return (f"depth {depth} read the embedding of token {t}, expected {prev_token} "
                    f"({'the given token' if depth == 1 else f'draft {depth - 1}'})")
        want = int(toy.lm_head(out).argmax())
        if drafts[depth - 1] != want:
            from_input = int(toy.lm_head(h_in).argmax())
            if drafts[depth - 1] == from_input:
                return (f"draft {depth} is the argmax of lm_head(hidden input of depth {depth}); it must be the argmax "
                        "of lm_head(out), the head's output")
            return f"draft {depth} is {drafts[depth - 1]}, but argmax(lm_head(out of depth {depth})) is {want}"
        prev_out, prev_token = out, want
    return "the drafts differ from the recursion's"


def check_mtp_draft(fn) -> str:
    for seed, K in ((0, 1), (1, 4), (2, 6), (3, 3)):
        toy = ToyHead(seed)
        g = torch.Generator().manual_seed(100 + seed)
        hidden, token = torch.randn(H, generator=g), int(torch.randint(V, (), generator=g))
        got = call(fn, toy.head, toy.embed, toy.lm_head, hidden.clone(), token, K)
        if isinstance(got, torch.Tensor):
            got = got.flatten().tolist()
        try:
            got = [operator.index(t) for t in got]
        except TypeError:
            raise Wrong(f"mtp_draft must return a list of K int token ids, got {got!r}") from None
        if len(got) != K:
            raise Wrong(f"mtp_draft returned {len(got)} drafts for K = {K}: one draft per depth, K in all")
        if list(got) != toy.expected(hidden, token, K):
            raise Wrong(f"K = {K}: {_explain(toy, hidden, token, K, list(got))}.")
    return "The drafts match the recursion on 4 random heads (K = 1, 3, 4, 6), every call reading the right inputs."


# -- exercise 2: the boosting loss ---------------------------------------------------------------------------
#
#     boost_loss(teacher [S, V], student [K, S, V], loss_mask [S]) -> (kl [K], one_minus_tv [K])
#
# teacher[p] are the frozen backbone's logits after x_0..x_p; student[k-1, j] are depth k's logits at slot j,
# which predicts x_(j+2), so its teacher is the backbone at position j+1. Slot j counts at depth k when
# j >= k-1 and loss_mask[j+1] (a reply token). kl[k-1] = mean over counted slots of KL(p ‖ q);
# one_minus_tv[k-1] = mean of sum_v min(p, q). The backbone is frozen: no gradient may reach `teacher`.

def _boost_reference(teacher: torch.Tensor, student: torch.Tensor, loss_mask: torch.Tensor):
    K, S, _ = student.shape
    p = torch.softmax(teacher.double()[1:], -1)  # slot j's teacher: position j+1
    logp = torch.log_softmax(teacher.double()[1:], -1)
    kls, accepts = [], []
    for k in range(1, K + 1):
        counted = loss_mask[1:].bool() & (torch.arange(S - 1) >= k - 1)
        logq = torch.log_softmax(student[k - 1, :-1].double(), -1)
        kls.append((p * (logp - logq)).sum(-1)[counted].mean())
        accepts.append(torch.minimum(p, logq.exp()).sum(-1)[counted].mean())
    return torch.stack(kls), torch.stack(accepts)


def _boost_case(seed: int, K: int = 3, S: int = 9, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(S, V, generator=g, dtype=torch.float64) * 1.5
    student = torch.randn(K, S, V, generator=g, dtype=torch.float64) * 1.5
    loss_mask = torch.zeros(S, dtype=torch.long)
    loss_mask[1 + seed % 3:] = 1  # a prompt of 1-3 tokens, then the reply
    loss_mask[-1] = 0  # and a padding slot at the end
    return teacher, student, loss_mask


def _boost_variants(teacher, student, loss_mask) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The outputs (kl, one_minus_tv) of the usual mistakes, keyed by the message that names each."""
    K, S, V = student.shape
    t, s = teacher.double(), student.double()
    slots = torch.arange(S - 1)

    def counted(mask_at=1, from_depth=True):
        return lambda k: loss_mask[mask_at:S - 1 + mask_at].bool() & ((slots >= k - 1) if from_depth else True)

    def scores(shift=1, kind="kl", where=None):
        where = where or counted()
        kls, tvs = [], []
        for k in range(1, K + 1):
            lt, ls = torch.log_softmax(t[shift:S - 1 + shift], -1), torch.log_softmax(s[k - 1, :-1], -1)
            forward = (lt.exp() * (lt - ls)).sum(-1)
            score = {"reverse": (ls.exp() * (ls - lt)).sum(-1),
                     "hard": -ls.gather(-1, lt.argmax(-1, keepdim=True))[:, 0]}.get(kind, forward)
            overlap = ((lt.argmax(-1) == ls.argmax(-1)).double() if kind == "argmax"
                       else torch.minimum(lt.exp(), ls.exp()).sum(-1))
            kls.append(score[where(k)].mean())
            tvs.append(overlap[where(k)].mean())
        return torch.stack(kls), torch.stack(tvs)

    mask_msg = "the loss mask is {}: only reply tokens count, and slot j's token is position j+1 (loss_mask[j+1])"
    return {
        "the teacher of slot j is the backbone at position j, not j+1: slot j predicts x_(j+2), the token the "
        "backbone predicts at position j+1": scores(shift=0),
        "KL is the wrong way round: boosting distils the teacher into the head, KL(p_backbone ‖ q_head) = "
        "sum p (log p - log q)": scores(kind="reverse"),
        "this is cross-entropy on the backbone's argmax token, a hard label: boosting matches the backbone's "
        "whole distribution (KL), which is what a sampled draft's acceptance 1 - TV depends on": scores(kind="hard"),
        "slots j < k-1 are counted at depth k: depth k's chain of stand-ins starts at the backbone's h at slot "
        "j-k+1, which does not exist before the sequence starts": scores(where=counted(from_depth=False)),
        mask_msg.format("ignored"): scores(where=lambda k: slots >= k - 1),
        mask_msg.format("read at slot j"): scores(where=counted(mask_at=0)),
        "1 - TV is sum_v min(p, q) of the probabilities; this looks like the argmax agreement, the acceptance "
        "of a greedy draft instead": scores(kind="argmax"),
    }


def check_boost_loss(fn) -> str:
    for seed, K in ((0, 3), (1, 1), (2, 4)):
        teacher, student, loss_mask = _boost_case(seed, K)
        want_kl, want_tv = _boost_reference(teacher, student, loss_mask)
        t_in, s_in = teacher.clone().requires_grad_(True), student.clone().requires_grad_(True)
        got = call(fn, t_in, s_in, loss_mask.clone())
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise Wrong(f"boost_loss must return a pair (kl [K], one_minus_tv [K]), got {type(got).__name__}")
        kl = as_tensor(got[0], f"kl (K = {K})", (K,))
        tv = as_tensor(got[1], f"one_minus_tv (K = {K})", (K,))
        close_kl = torch.allclose(kl.detach().double(), want_kl, rtol=1e-5, atol=1e-7)
        close_tv = torch.allclose(tv.detach().double(), want_tv, rtol=1e-5, atol=1e-7)
        if not (close_kl and close_tv):
            for mistake, (v_kl, v_tv) in _boost_variants(teacher, student, loss_mask).items():
                if (torch.allclose(kl.detach().double(), v_kl, rtol=1e-5, atol=1e-7)
                        and torch.allclose(tv.detach().double(), v_tv, rtol=1e-5, atol=1e-7)):
                    raise Wrong(f"K = {K}: {mistake}.")
            which = "kl" if not close_kl else "one_minus_tv"
            got_v, want_v = (kl, want_kl) if not close_kl else (tv, want_tv)
            raise Wrong(f"K = {K}: {which} is {[round(v, 4) for v in got_v.detach().double().tolist()]}, expected "
                        f"{[round(v, 4) for v in want_v.tolist()]}: per depth k, the mean over slots j >= k-1 with "
                        "loss_mask[j+1] of KL(softmax(teacher[j+1]) ‖ softmax(student[k-1, j])) and of sum min(p, q)")
        if not kl.requires_grad:
            raise Wrong("kl carries no gradient: the head learns from it, so compute it from `student` without "
                        "detaching or converting to Python numbers")
        kl.sum().backward()
        if t_in.grad is not None and t_in.grad.abs().max() > 0:
            raise Wrong("a gradient reaches `teacher`: the backbone is frozen in boosting, so its distribution is a "
                        "constant target (detach it, or compute it under torch.no_grad())")
        if s_in.grad is None or s_in.grad.abs().max() == 0:
            raise Wrong("no gradient reaches `student`: the loss must be a function of the head's logits")
    return ("Per-depth KL(backbone ‖ head) and 1 − TV match on 3 cases (K = 1, 3, 4), with the teacher shifted to "
            "position j+1, reply slots only, depth k from slot k-1, and gradients into the head alone.")
