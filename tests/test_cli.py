"""The two commands a user runs first: the demo and a benchmark."""
import json
import os
import subprocess
import sys


def run(*args, cwd):
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})


def test_demo_prints_strip_tau_and_speed(tmp_path):
    out = run("minispec", "demo", "--max-new-tokens", "24", "--drafter", "ngram", cwd=tmp_path).stdout
    assert "τ = " in out and "tokens/s vs autoregressive" in out
    assert "greedy speculative output equals autoregressive output" in out


def test_bench_ar_writes_json(tmp_path):
    res = run("minispec.bench", "ar", "--batch", "1", "2", "--max-new-tokens", "4", "--repeats", "1",
              "--json", str(tmp_path / "ar.json"), cwd=tmp_path)
    data = json.loads((tmp_path / "ar.json").read_text())
    assert [r["batch"] for r in data["rows"]] == [1, 2]
    assert all(r["new_tokens"] == 4 * r["batch"] for r in data["rows"])
    assert data["machine"]["torch"] and "tokens_per_s" in res.stdout
