"""QAD (minispec.quant.qad) on a tiny random target: KL falls, the teacher and static scales stay put,
dynamic scales follow the weights, gradients pass the fake quant, only the quantized matmul weights train
(every parameter with trained="all"), the reply data and its mask, and a resumed run equals a whole one."""
import copy

import pytest
import torch

from minispec import quant
from minispec.kl import kl_divergence
from minispec.quant import nvfp4
from minispec.quant.modules import QuantLinear, nvfp4_fake
from minispec.quant.qad import Settings, evaluate_kl, make_student, qad_loss, reply_batches, train
from minispec.targets.replies import Replies
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
    student = make_student(teacher, dict(quant.AGGRESSIVE, algorithm="four_over_six", scales="static"))
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
            assert scales[n].numel() and torch.equal(m.weight_block_scale, scales[n]), n  # frozen scales


def test_dynamic_scales_are_recomputed_from_the_trained_weights(teacher):
    student = make_student(teacher, dict(quant.AGGRESSIVE, scales="dynamic"))
    train(teacher, student, batches, Settings(steps=5, batch=2, seq_len=16, lr=5e-4, warmup=1), progress=False)
    layer = student.model.layers[1].mlp.down_proj
    w = layer.weight.detach()
    with torch.no_grad():  # block scales and the global scale both follow the trained weight
        assert torch.equal(layer.quantized_weight(), nvfp4_fake(w, nvfp4.global_scale_from_amax(w.abs().amax())))


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


def test_only_quantized_matmul_weights_train_by_default(teacher):
    recipe = {"name": "mlp-only", "rules": [["*mlp*", "w4a16"]]}  # attention and the head stay BF16
    student = make_student(teacher, recipe)
    trained = {n for n, p in student.named_parameters() if p.requires_grad}
    assert trained == set(quant.quantized_weights(student))
    assert trained and all(".mlp." in n and n.endswith("_proj.weight") for n in trained)
    before = snapshot(student)
    train(teacher, student, batches, Settings(steps=2, batch=2, seq_len=16, lr=1e-3, warmup=1), progress=False)
    for name, value in student.state_dict().items():
        if name in trained:
            assert not torch.equal(value, before[name]), name  # moved by QAD
        else:
            assert torch.equal(value, before[name]), name  # norms, embedding, attention, head: bit-identical


def test_trained_all_moves_every_parameter_and_a_bad_choice_is_refused(teacher):
    student = make_student(teacher, quant.AGGRESSIVE, trained="all")
    assert all(p.requires_grad for p in student.parameters())
    before = snapshot(student)
    train(teacher, student, batches, Settings(steps=2, batch=2, seq_len=16, lr=1e-3, warmup=1), progress=False)
    norms = [n for n in before if "norm" in n]
    assert norms and all(not torch.equal(student.state_dict()[n], before[n]) for n in norms)
    with pytest.raises(ValueError, match="trained must be one of"):
        make_student(teacher, quant.AGGRESSIVE, trained="norms")


def test_reply_batches_count_only_positions_that_predict_reply_tokens(teacher):
    ids = torch.tensor([[10, 11, 12, 13, 14, 0, 0], [20, 21, 22, 23, 24, 25, 26], [30, 31, 32, 33, 34, 35, 36]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]])
    s = Settings(batch=2, seq_len=6)
    draws = [reply_batches(Replies(ids, loss_mask), s)(step) for step in range(6)]
    x, mask = draws[0]
    assert all(b[0].shape[1] <= 6 for b in draws)  # cut at seq_len (the second row's last reply token is at 7)
    assert not any((b[0][:, 0] == 30).any() for b in draws)  # a reply that starts past seq_len is never drawn
    for row, m in zip(x.tolist(), mask.tolist()):
        src = 0 if row[0] == 10 else 1
        assert m == loss_mask[src, 1:].tolist()[:len(m) - 1] + [0]
    with pytest.raises(ValueError, match="raise --seq-len"):
        reply_batches(Replies(ids[2:], loss_mask[2:]), s)
    student = make_student(teacher, quant.AGGRESSIVE)
    kl = qad_loss(teacher, student, x, mask)
    with torch.no_grad():
        t, q = teacher(input_ids=x).logits, student(input_ids=x).logits
    per_token = kl_divergence(t, q, reduction="none")
    assert kl.item() == pytest.approx((per_token * mask).sum().item() / mask.sum().item(), rel=1e-5)
    assert evaluate_kl(teacher, student, x, mask=mask) == pytest.approx(kl.item(), rel=1e-5)
    with pytest.raises(ValueError, match="no position"):
        qad_loss(teacher, student, x, torch.zeros_like(mask))
