"""QAD (minispec.quant.qad) on a tiny random target: KL falls, the teacher and static scales stay put,
dynamic scales follow the weights, gradients pass the fake quant, and a resumed run equals a whole one."""
import copy

import pytest
import torch

from minispec import quant
from minispec.kl import kl_divergence
from minispec.quant.modules import QuantLinear, nvfp4_fake
from minispec.quant.qad import Settings, evaluate_kl, make_student, qad_loss, train
from tiny import tiny_gemma


@pytest.fixture(scope="module")
def teacher():
    m = tiny_gemma(layers=2, seed=5)
    with torch.no_grad():  # sharper logits than a random init gives, so quantization error is visible in KL
        m.get_input_embeddings().weight.mul_(5.0)
    return m


def batches(step, n=2, t=16):
    return torch.randint(4, 4096, (n, t), generator=torch.Generator().manual_seed(1000 + step))


FIXED = torch.randint(4, 4096, (4, 16), generator=torch.Generator().manual_seed(7))
S = Settings(steps=12, batch=2, seq_len=16, lr=5e-4, warmup=2, ckpt_every=4)


def snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_loss_is_forward_kl_of_next_token_logits(teacher):
    student = make_student(teacher, quant.AGGRESSIVE)
    x = FIXED[:2]
    with torch.no_grad():
        t, s = teacher(input_ids=x).logits, student(input_ids=x).logits
    manual = (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1).mean()
    assert qad_loss(teacher, student, x).item() == pytest.approx(manual.item(), rel=1e-4)
    assert qad_loss(teacher, student, x).item() == pytest.approx(kl_divergence(t, s).item(), rel=1e-6)
    assert manual > 0


def test_qad_lowers_kl_keeps_teacher_and_static_scales(teacher, tmp_path):
    before_teacher = snapshot(teacher)
    student = make_student(teacher, quant.AGGRESSIVE)
    scales = {n: m.weight_block_scale.clone() for n, m in student.named_modules() if isinstance(m, QuantLinear)}
    w0 = student.model.layers[0].mlp.up_proj.weight.detach().clone()
    kl0 = evaluate_kl(teacher, student, FIXED)
    fixed = lambda step: FIXED[(step % 2) * 2: (step % 2) * 2 + 2]  # noqa: E731  (fit the windows KL is measured on)
    history = train(teacher, student, fixed, Settings(steps=20, batch=2, seq_len=16, lr=1e-4, warmup=2), progress=False)
    kl1 = evaluate_kl(teacher, student, FIXED)
    assert len(history) == 20 and kl1 < 0.8 * kl0, (kl0, kl1)
    for k, v in teacher.state_dict().items():
        assert torch.equal(v, before_teacher[k]), k
    assert not any(p.requires_grad for p in teacher.parameters())
    assert not torch.equal(student.model.layers[0].mlp.up_proj.weight.detach(), w0)  # STE: weights got gradients
    for n, m in student.named_modules():
        if isinstance(m, QuantLinear):
            assert torch.equal(m.weight_block_scale, scales[n]), n  # frozen scales


def test_dynamic_scales_are_recomputed_from_the_trained_weights(teacher):
    student = make_student(teacher, dict(quant.AGGRESSIVE, scales="dynamic"))
    train(teacher, student, batches, Settings(steps=5, batch=2, seq_len=16, lr=5e-4, warmup=1), progress=False)
    layer = student.model.layers[1].mlp.down_proj
    w = layer.weight.detach()
    with torch.no_grad():
        assert torch.equal(layer.quantized_weight(), nvfp4_fake(w, layer.weight_global_scale))


def test_resume_gives_the_same_student(teacher, tmp_path):
    whole = make_student(teacher, quant.AGGRESSIVE)
    h_whole = train(teacher, whole, batches, S, tmp_path / "whole", progress=False)
    part = make_student(teacher, quant.AGGRESSIVE)
    train(teacher, part, batches, S, tmp_path / "split", stop_after=4, progress=False)
    resumed = make_student(teacher, quant.AGGRESSIVE)
    h_resumed = train(teacher, resumed, batches, S, tmp_path / "split", progress=False)
    assert h_resumed == pytest.approx(h_whole, rel=1e-5)
    for k, v in whole.state_dict().items():
        assert torch.allclose(v, resumed.state_dict()[k], atol=1e-6), k
    with pytest.raises(ValueError, match="other settings"):
        train(teacher, copy.deepcopy(resumed), batches, Settings(steps=13, batch=2, seq_len=16), tmp_path / "split",
              progress=False)
