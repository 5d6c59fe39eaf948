"""`python -m minispec.bench gpu` planned on a CPU: its shapes, byte counts and tables, before any GPU is lent."""
import argparse
import json

import pytest
import torch

from minispec import costs
from minispec.bench import gpu

V = 262_144


def dry_run(tmp_path) -> list[dict]:
    return gpu.bench_gpu(argparse.Namespace(dry_run=True, json=tmp_path / "gpu.json", repeats=1))


def test_dry_run_plans_every_kernel_at_every_shape_and_writes_both_files(tmp_path):
    rows = dry_run(tmp_path)
    kernel = [r for r in rows if r["step"] == "kernel"]
    ops = {r["op"] for r in kernel}
    assert ops == {"sampling T=1", "sampling T=1 top-k 50 top-p 0.9", "verify (sampled drafts)", "kl forward",
                   "kl forward+backward", "replay verify", "replay flush", "ssd chunked scan", "dflash attention",
                   "nvfp4 quantize", "nvfp4 dequantize", "w4a16 gemm", "w4a4 gemm"}
    for case in gpu.plan():
        methods = {r["method"] for r in kernel if (r["op"], r["shape"]) == (case.op, case.shape)}
        assert {"torch reference", "triton"} <= methods, case
    assert all(r["ms"] is None and r["note"] == "planned" for r in kernel)
    assert {r["step"] for r in rows} == {"pytest -m gpu", "kernel", "end to end"}
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["dry_run"] and saved["rows"] == rows
    table = (tmp_path / "gpu.md").read_text()
    assert "### kernel" in table and "| op | shape | method | MB |" in table


def test_decode_batches_span_1_to_64_at_nemotron_vocabulary():
    shapes = {case.shape for case in gpu.plan() if case.op.startswith(("sampling", "verify", "kl"))}
    assert {f"B={b} V={V} fp32" for b in (1, 8, 64)} <= shapes
    assert {f"N={b} V={V} bf16" for b in (1, 8, 64)} <= shapes


def by_op_and_shape(op: str, shape_start: str) -> int:
    [case] = [c for c in gpu.plan() if c.op == op and c.shape.startswith(shape_start)]
    return case.bytes


def test_byte_counts():
    # Sampling reads fp32 logits and writes fp32 probabilities: 2 x 4 bytes per vocabulary entry.
    assert by_op_and_shape("sampling T=1", "B=1 ") == 2 * 4 * V
    # KL forward reads two bf16 rows; forward+backward reads them twice and writes the bf16 gradient.
    assert by_op_and_shape("kl forward", "N=64 ") == 2 * 64 * V * 2
    assert by_op_and_shape("kl forward+backward", "N=64 ") == 5 * 64 * V * 2
    # Replay at batch 1 reads Super's fp32 state once: 4 MiB per layer, the cost model's figure.
    state = costs.mamba_state_bytes(costs.SUPER_MAMBA2)
    assert state == 4 * 2**20
    records = (16 * 128 * 64 + 16 * 8 * 128 + 16 * 128) * 4  # x, B, dt of 16 records
    window = (8 * 8 * 128 + 8 * 128 * 64) * 4  # C read and y written for a window of 8
    assert by_op_and_shape("replay verify", "b=1 ") == state + records + window
    assert by_op_and_shape("replay flush", "b=1 ") == 2 * state + records
    # DFlash attention at batch 1 reads the Bolt E4B drafter's per-layer KV cache (20 MiB over 5 layers),
    # less the one slot the window hides, plus q, the output and the block's own keys and values.
    kv_per_layer = costs.dflash_kv_cache_bytes(costs.E4B_DFLASH) / costs.E4B_DFLASH.num_hidden_layers
    assert kv_per_layer == 4 * 2**20
    one_slot = 2 * 8 * 128 * 2
    q_out_block = 2 * 8 * 32 * 128 * 2 + 2 * 8 * 8 * 128 * 2
    assert by_op_and_shape("dflash attention", "B=1 ") == kv_per_layer - one_slot + q_out_block
    # W4A16 at M = 1, K = N = 8192: 4-bit codes and one E4M3 scale per 16, plus x and y in bf16.
    assert by_op_and_shape("w4a16 gemm", "M=1 K=8192 N=8192") == 8192 * 8192 * 9 // 16 + 2 * 8192 * 2
    # W4A4 reads the same packed weight and bf16 x (quantized inside the kernel), and counts 2 M N K FLOPs.
    assert by_op_and_shape("w4a4 gemm", "M=1 ") == 8192 * 8192 * 9 // 16 + 2 * 8192 * 2
    [w4a4] = [c for c in gpu.plan() if c.op == "w4a4 gemm" and c.shape.startswith("M=2048 ")]
    assert w4a4.flops == 2 * 2048 * 8192 * 8192
    # The SSD scan of a 512-token prompt at Super's heads: x, dt, B, C in, y out, the two states; and per
    # token and head 2 Q (N + P) FLOPs inside its chunk of 128 plus 4 P N for the states.
    [ssd] = [c for c in gpu.plan() if c.op == "ssd chunked scan" and c.shape.startswith("T=512 ")]
    assert ssd.bytes == 512 * (2 * 128 * 64 + 128 + 2 * 8 * 128) * 4 + 2 * state
    assert ssd.flops == 512 * 128 * (2 * 128 * (128 + 64) + 4 * 64 * 128)


def test_peak_bandwidth_by_device_name():
    assert gpu.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu.peak_bandwidth("NVIDIA H100 NVL") == 3.9e12
    assert gpu.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert gpu.peak_bandwidth("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert gpu.peak_bandwidth("NVIDIA B200") == 8.0e12
    assert gpu.peak_bandwidth("NVIDIA GH200 480GB") is None  # a different memory system: no guess
    assert gpu.peak_bandwidth("Tesla T4") is None


def test_kernel_row_bandwidth_fraction_of_peak_and_speedup():
    case = gpu.Case("op", "shape", 4_800_000_000_000, None, {})  # 4.8 TB
    row = gpu.kernel_row(case, "triton", 2.0, 4.8e12, baseline=4.0)
    assert (row["GB_per_s"], row["of_peak"], row["speedup"], row["ms"]) == (2400.0, 0.5, 2.0, 2000.0)
    assert gpu.kernel_row(case, "triton", 2.0, None, None)["of_peak"] is None


def test_an_interrupted_run_keeps_the_rows_it_has(tmp_path, monkeypatch):
    def interrupt(results, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu, "run_end_to_end", interrupt)
    rows = dry_run(tmp_path)
    assert rows and {r["step"] for r in rows} == {"pytest -m gpu", "kernel"}
    assert json.loads((tmp_path / "gpu.json").read_text())["rows"] == rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_cuda_it_says_to_use_dry_run(tmp_path):
    with pytest.raises(RuntimeError, match="needs a CUDA device.*--dry-run"):
        gpu.bench_gpu(argparse.Namespace(dry_run=False, json=tmp_path / "gpu.json", repeats=1))
