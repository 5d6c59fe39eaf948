"""Checkers of exercise 04x: E2M1 rounding, the two-level NVFP4 scales of one tensor, and the QAD loss.

    e2m1_round(x: FloatTensor) -> FloatTensor             nearest of ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, ties to
                                                          even, saturating at ±6, sign kept
    nvfp4_scales(x: FloatTensor[R, K]) -> (g, scales)     g = max(amax / (6 · 448), 2**-126), a 0-d tensor;
                                                          scales [R, K // 16] = E4M3(clamp(a_b / (6 · g),
                                                          2**-9, 448)) as float32, a_b = max |x| of block b
                                                          (16 consecutive elements along the last dimension)
    qad_kl(teacher_logits: [B, T, V], student_logits: [B, T, V], mask: [B, T], temperature: float) -> 0-d
                                                          mean over the positions where mask is 1 of
                                                          KL(softmax(t / T) ‖ softmax(s / T)), no T² factor

The first two are compared exactly with `minispec.quant.nvfp4` (e2m1_round, global_scale_from_amax,
block_scales); qad_kl, value and gradient, with `minispec.kl.kl_divergence` masked as `quant.qad.qad_loss` does.
"""
from __future__ import annotations

import torch

from minispec.exercises.result import Wrong, as_tensor, call
from minispec.kl import kl_divergence
from minispec.quant.nvfp4 import (
    BLOCK_SIZE,
    E4M3_MAX,
    E4M3_MIN,
    block_scales,
    e2m1_round,
    e4m3_round,
    global_scale_from_amax,
)

# Every tie of the grid, each value on it, values between, beyond 6, negatives and tiny values.
E2M1_PROBES = torch.tensor([0.0, 0.1, 0.25, 0.3, 0.5, 0.74, 0.75, 0.76, 1.0, 1.25, 1.4, 1.5, 1.75, 1.9, 2.0, 2.5,
                            2.6, 3.0, 3.5, 3.9, 4.0, 4.9, 5.0, 5.1, 6.0, 6.5, 7.0, 100.0, 1e-6])
E2M1_PROBES = torch.cat([E2M1_PROBES, -E2M1_PROBES[1:]])
TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def check_e2m1_round(fn) -> str:
    x = E2M1_PROBES.clone()
    want = e2m1_round(x)
    got = as_tensor(call(fn, x.clone()), "e2m1_round(x)", tuple(x.shape))
    wrong = (got != want).nonzero().flatten()
    if len(wrong):
        i = int(wrong[0])
        v, g, w = x[i].item(), got[i].item(), want[i].item()
        if abs(v) in TIES:
            why = (f"{abs(v)} lies halfway between two grid values; ties go to the one with an even mantissa "
                   "(0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), as torch.round does "
                   "for integers")
        elif abs(v) > 6:
            why = "E2M1's largest value is 6: everything beyond saturates to ±6"
        elif v < 0 and g == -w:
            why = "the sign is lost: round |x| and put the sign back (torch.copysign)"
        elif abs(g) not in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0):
            why = "that is not an E2M1 value: the grid is ±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (steps 0.5, then 1, then 2)"
        else:
            why = "that is not the nearest grid value (the spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6])"
        wrong_list = ", ".join(f"{x[j].item():g} -> {got[j].item():g}" for j in wrong[:6].tolist())
        raise Wrong(f"e2m1_round({v:g}) = {g:g}, expected {w:g}: {why}.\nAll wrong values (first 6): {wrong_list}")
    return f"Exact on {len(x)} values: every tie, both signs, saturation at ±6."


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    spread = torch.randn(3, 64, generator=g) * 10.0 ** torch.randint(-3, 3, (3, 4, 1), generator=g).repeat_interleave(
        16, dim=2).flatten(1).float()
    with_zero_block = torch.randn(2, 32, generator=g)
    with_zero_block[1, 16:] = 0  # an all-zero block: its scale is the floor 2**-9, never 0
    return [spread, with_zero_block, torch.randn(1, 16, generator=g) * 1e-3, torch.zeros(2, 16)]


def check_nvfp4_scales(fn) -> str:
    for x in _tensors():
        R, K = x.shape
        g_want = global_scale_from_amax(x.abs().max())
        s_want = block_scales(x.reshape(R, K // BLOCK_SIZE, BLOCK_SIZE).abs().amax(-1), g_want)
        out = call(fn, x.clone())
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise Wrong(f"nvfp4_scales must return a pair (g, block_scales), got {type(out).__name__}")
        g_got = torch.as_tensor(out[0], dtype=torch.float32)
        s_got = as_tensor(out[1], "block_scales", (R, K // BLOCK_SIZE)).float()
        amax = x.abs().max().item()
        if g_got.numel() != 1:
            raise Wrong(f"g is one number per tensor (a 0-d tensor), got shape {list(g_got.shape)}")
        if g_got.item() != g_want.item():
            if amax == 0:
                why = ("for an all-zero tensor amax / 2688 is 0, and a 0 scale turns every block scale into 0/0 = NaN: "
                       "floor g at 2**-126, the smallest normal float32")
            elif abs(g_got.item() - amax / 6) <= 1e-6 * amax:
                why = "g = amax / 6 maps the tensor's max to 6 alone; g = amax / (6 · 448) leaves room for the block " \
                      "scale, which reaches 448 on the block holding the max"
            else:
                why = "g = amax / (6 · 448), with amax = max |x| over the whole tensor"
            raise Wrong(f"x of shape {[R, K]} with amax {amax:g}: g = {g_got.item():.6g}, expected "
                        f"{g_want.item():.6g}. {why}.")
        if torch.equal(s_got, s_want):
            continue
        block_amax = x.reshape(R, K // BLOCK_SIZE, BLOCK_SIZE).abs().amax(-1)
        ideal = (block_amax / (6 * g_want)).clamp(E4M3_MIN, E4M3_MAX)
        no_g = block_amax / 6
        if (s_got == 0).any() and (block_amax == 0).any():
            why = "an all-zero block got scale 0; clamp a_b / (6 · g) to at least 2**-9, the smallest E4M3 value"
        elif torch.allclose(s_got, ideal, rtol=1e-6):
            why = "the block scales are not rounded to E4M3: round them (e.g. .to(torch.float8_e4m3fn).float())"
        elif any(torch.allclose(s_got, s, rtol=1e-6) for s in (no_g, no_g.clamp(E4M3_MIN, E4M3_MAX),
                                                               e4m3_round(no_g.clamp(E4M3_MIN, E4M3_MAX)))):
            why = "a block scale is s_b = a_b / (6 · g): divide by the global scale g too (the block scales are " \
                  "E4M3 numbers in [2**-9, 448], and g carries the tensor's magnitude)"
        elif torch.allclose(s_got, torch.float_power(2, ideal.log2().floor()).float(), rtol=1e-6) or \
                (s_got <= ideal).all():
            why = "the block scales are rounded down; E4M3 rounds to the nearest value, ties to even"
        else:
            why = "s_b = E4M3(clamp(a_b / (6 · g), 2**-9, 448)), a_b the max |x| of 16 consecutive elements of a row"
        i = (s_got != s_want).nonzero()[0].tolist()
        raise Wrong(f"x of shape {[R, K]}: block_scales{i} = {s_got[tuple(i)].item():.6g}, expected "
                    f"{s_want[tuple(i)].item():.6g}. {why}.")
    return "Exact on 4 tensors: blocks of very different magnitudes, an all-zero block, a tiny tensor, all zeros."


def _qad_cases() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    g = torch.Generator().manual_seed(5)
    cases = []
    for temperature, scale in ((1.0, 2.0), (2.0, 3.0), (0.5, 1.0)):
        t = torch.randn(2, 5, 11, generator=g) * scale
        s = t + torch.randn(2, 5, 11, generator=g)  # a student near its teacher, as after PTQ
        mask = torch.ones(2, 5)
        mask[1, 3:] = 0  # the second sequence is padded after 3 tokens
        cases.append((t, s, mask, temperature))
    return cases


def _reference_qad_kl(t, s, mask, temperature):
    kl = kl_divergence(t, s, temperature=temperature, reduction="none")
    return (kl * mask).sum() / mask.sum()


def _qad_mistake(t, s, mask, temperature, got: float) -> str:
    """The likely mistake behind a wrong value `got`, found by computing the usual wrong variants."""
    tf, sf = t.float(), s.float()

    def masked(kl):
        return ((kl * mask).sum() / mask.sum()).item()

    def kl_rows(a, b, ta=temperature, tb=temperature):
        log_a, log_b = torch.log_softmax(a / ta, -1), torch.log_softmax(b / tb, -1)
        return (log_a.exp() * (log_a - log_b)).sum(-1)

    V = t.shape[-1]
    variants = [
        (masked(kl_rows(sf, tf)), "that is KL(student ‖ teacher), the reverse KL: QAD weighs by the teacher's "
                                  "distribution, Σ p_t (log p_t − log p_s)"),
        (kl_rows(tf, sf).mean().item(), "the padded positions are averaged in: average only where mask is 1"),
        (masked(kl_rows(tf, sf)) * temperature ** 2, "the loss is multiplied by T²; minispec's QAD loss (like "
                                                     "Model Optimizer's Megatron path) has no T² factor"),
        (masked(kl_rows(tf, sf)) / V, "the sum over the vocabulary was averaged instead (F.kl_div with "
                                      "reduction='mean' divides by B·T·V): sum over V, average over positions"),
        (kl_rows(tf, sf).sum().item() / t.shape[0], "the sum over all positions was divided by the batch size "
                                                   "(F.kl_div's reduction='batchmean' divides by the first "
                                                   "dimension) and the padded positions are in it: average only "
                                                   "over the positions where mask is 1"),
        (masked(kl_rows(tf, sf, 1.0, 1.0)), "the temperature is missing: divide both logits by T before the "
                                            "softmax"),
        (masked(kl_rows(tf, sf, 1.0, temperature)), "only the student's logits are divided by T: divide the "
                                                    "teacher's too"),
        (masked(kl_rows(tf, sf, temperature, 1.0)), "only the teacher's logits are divided by T: divide the "
                                                    "student's too"),
    ]
    for value, why in variants:
        if abs(value - got) <= 1e-5 * max(1.0, abs(value)):
            return why
    return ("KL(p_t ‖ p_s) = Σ_v p_t(v) (log p_t(v) − log p_s(v)) with p = softmax(logits / T), summed over the "
            "vocabulary and averaged over the positions where mask is 1")


def check_qad_kl(fn) -> str:
    for t, s, mask, temperature in _qad_cases():
        want = _reference_qad_kl(t, s, mask, temperature)
        student = s.clone().requires_grad_(True)
        out = call(fn, t.clone(), student, mask.clone(), temperature)
        if not isinstance(out, (torch.Tensor, float, int)):
            raise Wrong(f"qad_kl returns the loss as a 0-d tensor, got {type(out).__name__}")
        got = torch.as_tensor(out) if not isinstance(out, torch.Tensor) else out
        if got.numel() != 1:
            raise Wrong(f"qad_kl returns one number (a 0-d tensor), got shape {list(got.shape)}")
        if not torch.allclose(got.detach().float(), want, rtol=1e-5, atol=1e-7):
            why = _qad_mistake(t, s, mask, temperature, got.item())
            raise Wrong(f"T = {temperature:g}: qad_kl = {got.item():.6g}, expected {want.item():.6g}: {why}.")
        if not got.requires_grad:
            raise Wrong("the loss has no gradient to the student's logits: QAD trains the student through it "
                        "(do not detach the student or call .item())")
        (grad,) = torch.autograd.grad(got.float().sum(), student)
        p_t, p_s = torch.softmax(t / temperature, -1), torch.softmax(s / temperature, -1)
        want_grad = (p_s - p_t) / temperature * mask[..., None] / mask.sum()
        if not torch.allclose(grad, want_grad, rtol=1e-4, atol=1e-7):
            raise Wrong(f"T = {temperature:g}: the value is right but its gradient to the student's logits is not "
                        "(p_s − p_t) / (T · positions): compute the loss from the student's logits directly")
    return "Value and gradient exact at T = 1, 2 and 0.5, with a padded sequence."
