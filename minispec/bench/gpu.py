"""`python -m minispec.bench gpu`: the one check to run when a CUDA machine is lent, in under 8 minutes.

`bench_gpu(args)` runs, printing a line per step and saving its JSON and Markdown after every row (an
interrupted run keeps what it has, Ctrl-C included):
1. `pytest -m gpu`: the kernels against their references at real sizes, in a subprocess with a limit.
2. Each kernel against its PyTorch reference at realistic shapes: decode batches 1-64, V = 262,144
   (Nemotron 3.5's vocabulary) for sampling, verify and KL, Nemotron 3.5 Super's Mamba-2 heads for
   replay and for the chunked SSD scan of a prefill, the Bolt E4B drafter's heads for DFlash attention,
   K, N = 2,560-8,192 for NVFP4 and the W4A16 and W4A4 GEMMs. Every row carries the bytes the operation
   must move at least (each input read once, each output written once: `Case.bytes`), the bandwidth
   that makes, and its fraction of the device's peak (`PEAK_BANDWIDTH`, by device name). Most of these
   kernels are memory-bound at these shapes, so the fraction says how far each is from its floor. The
   two that are not at every shape, the SSD scan (its intra-chunk products) and W4A4 at M = 2,048, also
   carry their floating-point operations (`Case.flops`) and the TFLOP/s they reach.
3. End to end: autoregressive vs speculative decoding of bolt-mini on the GPU (n-gram, draft LM and
   DFlash drafters), tokens/s and tau, greedy, with the output checked equal to autoregressive.
4. torch.compile of each reference, at the largest shape of each operation, while the time budget
   (`BUDGET_S`) lasts: Inductor compiles for tens of seconds per function, so these rows come last.
Times are best-of-`repeats` from `minispec.bench.timing.timed`, which synchronizes the device before
it starts and stops the clock.

`args.dry_run` plans every row, its shape and its byte count, without CUDA (tests/test_bench_gpu.py).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from minispec import costs
from minispec.bench.timing import timed
from minispec.results import machine
from minispec.speculative.stats import SpecStats

BUDGET_S = 420  # seconds for the whole check, leaving a minute of the 8 for start-up and slack
PYTEST_TIMEOUT_S = 180
V = 262_144  # Nemotron 3.5's vocabulary
BATCHES = (1, 8, 64)
METHODS = ("torch reference", "triton", "torch.compile(reference)")

# Peak memory bandwidth, bytes/s, from NVIDIA's data sheets; the first key found (as a whole word) in
# torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM5, which torch names "NVIDIA H100 80GB HBM3"
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,  # the 40 GB boards, SXM4 and PCIe
    "B200": 8.0e12,
}


def peak_bandwidth(device_name: str) -> float | None:
    """Bytes/s of the first PEAK_BANDWIDTH key that is a whole word of `device_name`; None if none is."""
    for key, peak in PEAK_BANDWIDTH.items():
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name):
            return peak
    return None


@dataclass
class Case:
    """One operation at one shape: what it must move at least, and how to run it.

    make(device) -> the arguments of every method; methods: name -> fn(*arguments).
    flops: the multiply-adds x 2 it must do, where that is worth reporting (0: not reported).
    """

    op: str
    shape: str
    bytes: int
    make: object = field(repr=False)
    methods: dict = field(repr=False)
    flops: int = 0


# --- the cases ------------------------------------------------------------------------------------

def _dispatched(fn) -> dict:
    return {"torch reference": fn.reference, "triton": fn.kernel}


def _sampling_cases() -> list[Case]:
    from minispec.speculative.sampling import sampling_probs

    cases = []
    for label, kwargs in (("T=1", {}), ("T=1 top-k 50 top-p 0.9", {"top_k": 50, "top_p": 0.9})):
        methods = {name: partial(fn, temperature=1.0, **kwargs) for name, fn in _dispatched(sampling_probs).items()}
        for B in BATCHES:
            cases.append(Case(f"sampling {label}", f"B={B} V={V} fp32", B * V * 4 + B * V * 4,
                              lambda device, B=B: (torch.randn(B, V, device=device) * 3,), methods))
    return cases


def _verify_cases() -> list[Case]:
    from minispec.speculative.verify import verify

    K = 7  # a block of 8, as the Bolt E4B drafter drafts
    cases = []
    for B in BATCHES:
        def make(device, B=B):
            g = torch.Generator(device).manual_seed(0)
            p = torch.softmax(torch.randn(B, K + 1, V, device=device, generator=g), dim=-1)
            q = torch.softmax(torch.randn(B, K, V, device=device, generator=g), dim=-1)
            drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).reshape(B, K)
            return drafts, p, q

        # The wrapper checks that every row of p and q is a distribution, so each is read at least once.
        cases.append(Case("verify (sampled drafts)", f"B={B} K={K} V={V} fp32", (B * (K + 1) * V + B * K * V) * 4,
                          make, _dispatched(verify)))
    return cases


def _kl_cases() -> list[Case]:
    from minispec.kl import kl_divergence

    def forward_backward(fn):
        def run(teacher, student):
            student.grad = None
            fn(teacher, student).backward()
        return run

    cases = []
    for B in BATCHES:
        def make(device, B=B):
            g = torch.Generator(device).manual_seed(0)
            teacher = (torch.randn(B, V, device=device, generator=g) * 3).to(torch.bfloat16)
            student = (torch.randn(B, V, device=device, generator=g) * 3).to(torch.bfloat16).requires_grad_()
            return teacher, student

        logits = B * V * 2
        cases.append(Case("kl forward", f"N={B} V={V} bf16", 2 * logits, make,
                          {name: (lambda f: lambda t, s: f(t, s.detach()))(fn)
                           for name, fn in _dispatched(kl_divergence).items()}))
        # The backward pass reads both logits again and writes the gradient.
        cases.append(Case("kl forward+backward", f"N={B} V={V} bf16", 2 * logits + 3 * logits, make,
                          {name: forward_backward(fn) for name, fn in _dispatched(kl_divergence).items()}))
    return cases


def _replay_cases() -> list[Case]:
    from minispec.ssm.replay import replay_flush, replay_verify

    s = costs.SUPER_MAMBA2
    H, P, N, G = s.num_heads, s.head_dim, s.state_size, s.n_groups
    L, T = 16, 8  # a ring of 16 records since the checkpoint; a verify window of 8
    cases = []
    for b in BATCHES:
        def make(device, b=b):
            g = torch.Generator(device).manual_seed(0)

            def randn(*shape):
                return torch.randn(*shape, device=device, generator=g)

            A = -torch.rand(H, device=device, generator=g) - 0.5
            return (randn(b, H, P, N), randn(b, L, H, P), torch.rand(b, L, H, device=device, generator=g) * 0.1,
                    randn(b, L, G, N), randn(b, T, G, N), A, randn(H))

        state, records = b * H * P * N * 4, (b * L * H * P + b * L * G * N + b * L * H) * 4
        window = (b * T * G * N + b * T * H * P) * 4  # C read, y written
        cases.append(Case("replay verify", f"b={b} Super heads L={L} T={T} fp32", state + records + window, make,
                          {name: (lambda f: lambda S0, x, dt, B, C, A, D: f(S0, x, dt, B, C, A, D, L - T))(fn)
                           for name, fn in _dispatched(replay_verify).items()}))
        cases.append(Case("replay flush", f"b={b} Super heads L={L} fp32", 2 * state + records, make,
                          {name: (lambda f: lambda S0, x, dt, B, C, A, D: f(S0, x, dt, B, A))(fn)
                           for name, fn in _dispatched(replay_flush).items()}))
    return cases


def _ssd_cases() -> list[Case]:
    from minispec.ssm.ssd import ssd_chunked

    s = costs.SUPER_MAMBA2
    H, P, N, G = s.num_heads, s.head_dim, s.state_size, s.n_groups
    Q = 128  # Super's chunk size
    cases = []
    for T in (512, 4096):  # a short and a long prompt, one sequence
        def make(device, T=T):
            g = torch.Generator(device).manual_seed(0)

            def randn(*shape):
                return torch.randn(*shape, device=device, generator=g)

            dt = torch.rand(1, T, H, device=device, generator=g) * 0.1
            A = -torch.rand(H, device=device, generator=g) - 0.5
            return randn(1, T, H, P), dt, A, randn(1, T, G, N), randn(1, T, G, N), randn(H), randn(1, H, P, N)

        # x, dt, B, C read, y written; the initial and the final state.
        nbytes = T * (2 * H * P + H + 2 * G * N) * 4 + 2 * H * P * N * 4
        # Per token and head: C B^T and the masked product with x inside its chunk (2 Q (N + P)), its part
        # of the chunk's state and of the entering state's read-out (4 P N).
        flops = T * H * (2 * Q * (N + P) + 4 * P * N)
        cases.append(Case("ssd chunked scan", f"T={T} Super heads Q={Q} fp32", nbytes, make,
                          {name: (lambda f: lambda *a: f(*a, chunk_size=Q))(fn)
                           for name, fn in _dispatched(ssd_chunked).items()}, flops))
    return cases


def _attention_cases() -> list[Case]:
    from minispec.dflash.attention import dflash_attention

    e = costs.E4B_DFLASH
    T, Hq, Hkv, D, W = e.block_size, e.num_attention_heads, e.num_key_value_heads, e.head_dim, e.sliding_window
    C = W  # a full window of cached context
    cases = []
    for B in BATCHES:
        def make(device, B=B):
            g = torch.Generator(device).manual_seed(0)

            def randn(*shape):
                return torch.randn(*shape, device=device, generator=g).to(torch.bfloat16)

            lens = torch.full((B,), C, device=device)
            return randn(B, T, Hq, D), randn(B, C, Hkv, D), randn(B, C, Hkv, D), randn(B, T, Hkv, D), randn(
                B, T, Hkv, D), lens

        visible = min(C, W - 1)  # slots at distance < W from the block's first query
        nbytes = (2 * B * T * Hq * D + 2 * B * visible * Hkv * D + 2 * B * T * Hkv * D) * 2
        cases.append(Case("dflash attention", f"B={B} T={T} {Hq}q/{Hkv}kv x {D} ctx={C} W={W} bf16", nbytes, make,
                          {name: (lambda f: lambda *a: f(*a[:6], window=W))(fn)
                           for name, fn in _dispatched(dflash_attention).items()}))
    return cases


def _nvfp4_cases() -> list[Case]:
    from minispec.quant.gemm import w4a4_matmul, w4a16_matmul
    from minispec.quant.nvfp4 import dequantize, global_scale_from_amax, quantize

    cases = []
    for K, N in ((2560, 2560), (8192, 8192)):
        packed = N * K // 2 + N * K // 16  # E2M1 codes and E4M3 block scales

        def weight(device, K=K, N=N):
            g = torch.Generator(device).manual_seed(0)
            return ((torch.randn(N, K, device=device, generator=g) * 0.02).to(torch.bfloat16),)

        def fields(device, K=K, N=N):
            w = quantize.reference(weight(device, K, N)[0])
            return w.codes, w.block_scales, w.global_scale

        cases.append(Case("nvfp4 quantize", f"[{N}, {K}] bf16", N * K * 2 + packed, weight, _dispatched(quantize)))
        cases.append(Case("nvfp4 dequantize", f"[{N}, {K}] to bf16", packed + N * K * 2, fields,
                          {name: (lambda f: lambda c, s, g: f(c, s, g, torch.bfloat16))(fn)
                           for name, fn in _dispatched(dequantize).items()}))
    for K, N in ((2560, 8192), (8192, 2560), (8192, 8192)):
        for M in (1, 16, 64):
            def make(device, K=K, N=N, M=M):
                g = torch.Generator(device).manual_seed(0)
                w = quantize.reference((torch.randn(N, K, device=device, generator=g) * 0.02).to(torch.bfloat16))
                return torch.randn(M, K, device=device, generator=g).to(torch.bfloat16), w

            nbytes = N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2
            cases.append(Case("w4a16 gemm", f"M={M} K={K} N={N} bf16", nbytes, make, _dispatched(w4a16_matmul)))
    for M in (1, 64, 2048):  # decoding, a verify batch, a prefill
        K = N = 8192

        def make(device, K=K, N=N, M=M):
            g = torch.Generator(device).manual_seed(0)
            w = quantize.reference((torch.randn(N, K, device=device, generator=g) * 0.02).to(torch.bfloat16))
            x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
            return x, w, global_scale_from_amax(x.abs().amax().float())

        nbytes = N * K // 2 + N * K // 16 + M * K * 2 + M * N * 2
        cases.append(Case("w4a4 gemm", f"M={M} K={K} N={N} bf16", nbytes, make, _dispatched(w4a4_matmul),
                          2 * M * N * K))
    return cases


def plan() -> list[Case]:
    """Every kernel case, in the order they run."""
    return [*_sampling_cases(), *_verify_cases(), *_kl_cases(), *_replay_cases(), *_ssd_cases(),
            *_attention_cases(), *_nvfp4_cases()]


# --- running --------------------------------------------------------------------------------------

class Results:
    """The rows so far, written to `json_path` and `json_path.with_suffix('.md')` after every row."""

    def __init__(self, json_path: Path, dry_run: bool):
        self.json_path, self.dry_run, self.rows = json_path, dry_run, []
        self.start = time.perf_counter()

    def left(self) -> float:
        return BUDGET_S - (time.perf_counter() - self.start)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(f"[{time.perf_counter() - self.start:5.0f} s] " + "  ".join(f"{k}={v}" for k, v in row.items()
                                                                         if v not in (None, "")), flush=True)
        self.save()

    def save(self) -> None:
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps({"bench": "gpu", "dry_run": self.dry_run, "machine": machine(),
                                              "rows": self.rows}, indent=1))
        self.json_path.with_suffix(".md").write_text(markdown(self.rows))


def kernel_row(case: Case, method: str, seconds: float | None, peak: float | None, baseline: float | None,
               note: str = "") -> dict:
    """A row of step 2 or 4: time, bandwidth over the case's byte count, fraction of peak, speedup (and the
    TFLOP/s of the cases that count their operations)."""
    row = {"step": "kernel", "op": case.op, "shape": case.shape, "method": method, "MB": round(case.bytes / 1e6, 2),
           "ms": None, "GB_per_s": None, "of_peak": None, "TFLOP_per_s": None, "speedup": None, "note": note}
    if seconds is not None:
        bandwidth = case.bytes / seconds
        row.update(ms=round(seconds * 1e3, 4), GB_per_s=round(bandwidth / 1e9, 1),
                   TFLOP_per_s=round(case.flops / seconds / 1e12, 2) if case.flops else None,
                   of_peak=None if peak is None else round(bandwidth / peak, 3),
                   speedup=None if baseline is None else round(baseline / seconds, 2))
    return row


def run_pytest_gpu(results: Results) -> None:
    """Step 1: `pytest -m gpu` over the repository's tests/, if this is a checkout."""
    tests = Path("tests")
    if not tests.is_dir():
        results.add({"step": "pytest -m gpu", "note": "skipped: no tests/ folder here (run from the repository root)"})
        return
    if results.dry_run:
        results.add({"step": "pytest -m gpu", "note": f"planned, limit {PYTEST_TIMEOUT_S} s"})
        return
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "tests"]
    start = time.perf_counter()
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=PYTEST_TIMEOUT_S)
        lines = out.stdout.strip().splitlines()
        summary, failed = (lines[-1] if lines else "no output"), out.returncode != 0
        detail = "\n".join(lines[-40:]) + out.stderr[-2000:] if failed else ""
    except subprocess.TimeoutExpired as e:
        summary, failed = f"stopped after {PYTEST_TIMEOUT_S} s", True
        detail = (e.stdout or b"").decode(errors="replace")[-4000:] if isinstance(e.stdout, bytes) else (e.stdout or "")
    results.add({"step": "pytest -m gpu", "seconds": round(time.perf_counter() - start, 1), "summary": summary,
                 "ok": not failed, "note": detail})


def run_kernels(cases: list[Case], results: Results, repeats: int, peak: float | None) -> dict:
    """Step 2: reference and kernel at every case. Returns {op: seconds of the reference} at the largest
    shape of each op, for step 4."""
    baselines = {}
    for case in cases:
        if results.dry_run:
            for method in METHODS[:2]:
                results.add(kernel_row(case, method, None, peak, None, "planned"))
            continue
        baselines[case.op] = time_methods(case, {m: case.methods[m] for m in METHODS[:2]}, results, repeats, peak)
    return baselines


def run_compiled(cases: list[Case], results: Results, repeats: int, peak: float | None, baselines: dict) -> None:
    """Step 4: torch.compile(reference) at the largest shape of each op, while the budget lasts."""
    largest = {case.op: case for case in cases}  # cases run from small to large within an op
    for case in largest.values():
        if results.dry_run:
            results.add(kernel_row(case, METHODS[2], None, peak, None, "planned"))
        elif results.left() < 60:  # an Inductor compile takes tens of seconds
            results.add(kernel_row(case, METHODS[2], None, peak, None, "skipped: time budget"))
        else:
            time_methods(case, {METHODS[2]: torch.compile(case.methods["torch reference"])}, results, repeats, peak,
                         baselines.get(case.op))


def time_methods(case: Case, methods: dict, results: Results, repeats: int, peak: float | None,
                 baseline: float | None = None) -> float | None:
    """A row per method on the case's inputs (made here, freed on return); the reference's seconds if it ran."""
    torch.cuda.empty_cache()
    args = case.make("cuda")
    for method, fn in methods.items():
        try:
            seconds = timed(partial(fn, *args), repeats, warmup=2, inner=5, cuda=True)[0]
        except Exception as e:  # a method that cannot run here gets a row that says why
            results.add(kernel_row(case, method, None, peak, None, f"{type(e).__name__}: {e}"[:200]))
            continue
        if method == "torch reference":
            baseline = seconds
        results.add(kernel_row(case, method, seconds, peak, baseline))
    return baseline


def run_end_to_end(results: Results, max_new_tokens: int = 64, prompts: int = 8) -> None:
    """Step 3: bolt-mini on the GPU, batch 1, greedy: tokens/s and tau of each drafter against plain decoding."""
    drafters = ("ngram", "bolt-nano", "bolt-mini-dflash")
    if results.dry_run:
        for name in ("-", *drafters):
            results.add({"step": "end to end", "drafter": name, "note": f"planned: {prompts} prompts, "
                                                                       f"{max_new_tokens} new tokens"})
        return
    if results.left() < 60:
        results.add({"step": "end to end", "note": "skipped: time budget"})
        return
    import minispec as ms

    model, _ = ms.load_target("bolt-mini")
    model.to("cuda")
    chosen = [p.to("cuda") for p in ms.load_evalset().prompts[:prompts]]

    def count(outs):
        return sum(int(o.lengths.sum()) for o in outs)

    ar_s, ar = timed(lambda: [ms.autoregressive_generate(model, p, max_new_tokens) for p in chosen], 2, cuda=True)
    results.add({"step": "end to end", "drafter": "-", "method": "autoregressive", "tau": 1.0,
                 "tokens_per_s": round(count(ar) / ar_s, 1), "speedup": 1.0, "equal_to_ar": True})
    for name in drafters:
        try:
            drafter = ms.load_drafter(name, model)
            # load_drafter builds a drafter's own network on the CPU; it must sit beside the target.
            for part in vars(drafter).values():
                if isinstance(part, torch.nn.Module):
                    part.to("cuda")
            s, outs = timed(lambda drafter=drafter: [ms.speculative_generate(model, drafter, p, max_new_tokens)
                                                     for p in chosen], 2, cuda=True)
        except Exception as e:
            results.add({"step": "end to end", "drafter": name, "note": f"{type(e).__name__}: {e}"[:300]})
            continue
        tau = SpecStats([c for o in outs for c in o.stats.cycles]).tau
        results.add({"step": "end to end", "drafter": name, "method": "speculative", "tau": round(tau, 3),
                     "tokens_per_s": round(count(outs) / s, 1),
                     "speedup": round((count(outs) / s) / (count(ar) / ar_s), 3),
                     "equal_to_ar": all(torch.equal(o.tokens.cpu(), a.tokens.cpu()) for o, a in zip(outs, ar))})


def bench_gpu(args) -> list[dict]:
    """The whole GPU check (see the module docstring). args: repeats, json, dry_run."""
    dry_run = bool(getattr(args, "dry_run", False))
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("python -m minispec.bench gpu needs a CUDA device; --dry-run plans the run without one")
    repeats = int(getattr(args, "repeats", 3) or 3)
    results = Results(getattr(args, "json", None) or Path("bench-results") / "gpu.json", dry_run)
    device = "(dry run)" if dry_run else torch.cuda.get_device_name()
    peak = peak_bandwidth(device) if not dry_run else PEAK_BANDWIDTH["H200"]
    print(f"GPU check on {device}; peak bandwidth {peak and peak / 1e12} TB/s; budget {BUDGET_S} s", flush=True)
    cases = plan()
    baselines = {}
    steps = [("pytest -m gpu", lambda: run_pytest_gpu(results)),
             ("kernel", lambda: baselines.update(run_kernels(cases, results, repeats, peak))),
             ("end to end", lambda: run_end_to_end(results)),
             ("kernel", lambda: run_compiled(cases, results, repeats, peak, baselines))]
    for step, run in steps:
        try:
            run()
        except KeyboardInterrupt:
            print("stopped: keeping the rows so far", flush=True)
            break
        except Exception as e:  # one failing step must not cost the others on a machine lent for minutes
            results.add({"step": step, "note": f"failed: {type(e).__name__}: {e}"[:300]})
    results.save()
    print(f"wrote {results.json_path} and {results.json_path.with_suffix('.md')}", flush=True)
    return results.rows


# --- the Markdown tables --------------------------------------------------------------------------

def markdown(rows: list[dict]) -> str:
    """One table per step, in the order the rows came, ready for docs/benchmarks.md."""
    out = []
    for step in dict.fromkeys(row["step"] for row in rows):
        table = [row for row in rows if row["step"] == step]
        if step == "kernel":  # the compiled rows came last; show them beside their op
            cases = list(dict.fromkeys((r.get("op"), r.get("shape")) for r in table))
            methods = [*METHODS, None]
            table.sort(key=lambda r: (cases.index((r.get("op"), r.get("shape"))), methods.index(r.get("method"))))
        columns = list(dict.fromkeys(key for row in table for key in row if key not in ("step", "note")))
        has_notes = any(row.get("note") for row in table)
        columns += ["note"] if has_notes else []
        out.append(f"### {step}\n")
        out.append("| " + " | ".join(columns) + " |")
        out.append("|" + "---|" * len(columns))
        for row in table:
            cells = [_cell(row.get(c)) for c in columns]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _cell(value) -> str:
    if value is None:
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")[:200]
