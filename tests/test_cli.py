"""The two commands a user runs first: the demo and a benchmark."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minispec as ms
from minispec.__main__ import main
from minispec.results import load_result
from minispec.targets import smollm2

ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})


def test_demo_prints_strip_tau_and_speed(tmp_path):
    out = run("minispec", "demo", "--target", "bolt-mini", "--max-new-tokens", "24", cwd=tmp_path).stdout
    assert "drafter ngram" in out and "frozen eval set #0" in out
    assert "τ = " in out and "tokens/s vs autoregressive" in out
    assert "greedy speculative output equals autoregressive output" in out


@pytest.mark.slow
def test_demo_runs_smollm2_with_its_dflash_drafter_on_mt_bench():
    # From the repository root, as the README runs it: kernels/ must not shadow Hugging Face's `kernels`.
    out = run("minispec", "demo", "--max-new-tokens", "16", cwd=ROOT).stdout
    assert "drafter smollm2-135m-dflash" in out and "MT-Bench question #" in out
    assert "τ = " in out and "per-position acceptance" in out and "tokens/s vs autoregressive" in out
    assert "greedy speculative output equals autoregressive output" in out
    # Beside one question, the shipped drafter's tau over all of MT-Bench, from the shipped benchmark
    rows = [r for r in load_result("smollm2-135m-dflash-mtbench")["rows"] if "policy" in r]
    assert rows[0]["prompts"] == 80 and f"τ = {rows[0]['tau']:.2f} at T = 0" in out


@pytest.mark.slow
def test_demo_refuses_a_benchmark_of_other_weights(monkeypatch):
    import minispec.__main__ as demo

    real = demo.load_result
    monkeypatch.setattr(demo, "load_result", lambda name: json.loads(json.dumps(real(name)).replace(
        real(name)["rows"][0]["drafter_weights"], "0" * 16)))
    model, _ = ms.load_target("smollm2-135m")
    with pytest.raises(ValueError, match="measured with other weights"):
        demo.benchmark_line("smollm2-135m-dflash", ms.load_drafter("smollm2-135m-dflash", model))


def test_demo_passes_the_loaders_error_through(monkeypatch):
    """Without the model's package, the demo ends with the loader's own message, which names the pip command."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == smollm2.PACKAGE
                        else find_spec(name, *a))
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--threads", str(torch.get_num_threads())])  # leaves this process's threads as they are
    assert str(exit_.value.code).startswith("python -m minispec demo: the target 'smollm2-135m' comes from")
    assert str(exit_.value.code).endswith(f"run `{smollm2.INSTALL}`")


def test_bench_ar_writes_json(tmp_path):
    res = run("minispec.bench", "ar", "--batch", "1", "2", "--max-new-tokens", "4", "--repeats", "1",
              "--json", str(tmp_path / "ar.json"), cwd=tmp_path)
    data = json.loads((tmp_path / "ar.json").read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    assert all(r["new_tokens"] == 4 * r["batch"] for r in data["rows"])
    assert data["machine"]["torch"] and "tokens_per_s" in res.stdout
    assert data["command"] == ("python -m minispec.bench ar --batch 1 2 --max-new-tokens 4 --repeats 1 --json "
                               f"{tmp_path / 'ar.json'}")


def test_bench_forward_sets_each_window_against_one_token(tmp_path, monkeypatch):
    """Each thread count's rows are divided by its own one-token row, bare and minispec apart (timings are
    stubbed: only the arithmetic and the layout are checked)."""
    from minispec.bench import decoding
    from minispec.bench import main as bench_main

    monkeypatch.setattr(decoding, "forward_costs", lambda model, context, n, repeats: (0.01 * (1 + n), 0.02 * n))
    bench_main(["forward", "--tokens", "8", "4", "--repeats", "1", "--json", str(tmp_path / "f.json")])
    rows = json.loads((tmp_path / "f.json").read_text())["rows"]
    assert [(r["threads"], r["n"]) for r in rows] == [(1, 1), (1, 4), (1, 8), (2, 1), (2, 4), (2, 8)]
    assert [r["bare_ratio"] for r in rows[:3]] == [1.0, 2.5, 4.5]
    assert [r["minispec_ratio"] for r in rows[:3]] == [1, 4, 8]
    assert rows[2]["minispec_over_bare"] == round(0.16 / 0.09, 3)


def test_forward_costs_time_the_same_window_both_ways():
    from minispec.bench.decoding import forward_costs

    model, tok = ms.load_target("bolt-mini")
    context = ms.load_evalset().prompts[0]
    bare, ours = forward_costs(model, context, 5, repeats=1)
    assert bare > 0 and ours > 0


def test_served_model_counts_a_tied_head_as_read_and_an_untied_embedding_as_looked_up():
    from transformers import LlamaConfig, LlamaForCausalLM

    from minispec.bench.decoding import served_model

    def llama(tied):
        return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))

    tied, untied = llama(True), llama(False)
    n_tied = sum(p.numel() for p in tied.parameters())
    m = served_model(tied)
    assert m.weight_bytes == m.active_weight_bytes == 4 * n_tied and m.flops_per_token == 2 * n_tied
    u = served_model(untied)
    assert u.active_weight_bytes == u.weight_bytes - 4 * 1000 * 64  # the embedding rows are looked up, not read
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head_dim x float32
