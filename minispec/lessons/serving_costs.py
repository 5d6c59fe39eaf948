"""Notebook 06 (serving costs): how the batch changes what speculative decoding buys. The live CPU measurement,
the speedup-by-batch figure (a dense target and a mixture of experts, side by side), the margin Bolt E4B + DFlash
keeps at the write-up's 64-sequence setup, checkpoint + replay's modelled gain beside the Super/Lightning
paper's measurement, memory per request, the sliders, and the closing table. Every modelled number comes from
`minispec.costs`; the published figures it is set against are the constants below."""
from __future__ import annotations

import torch

from minispec import costs
from minispec.bench.timing import timed
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.target import target_adapter
from minispec.viz.plots import PALETTE

# Bolt E4B with its DFlash drafter: the Bolt E4B write-up's MT-Bench acceptance length 4.01 (greedy) over
# blocks of 8 (7 drafts), one drafter pass per cycle over the whole block.
E4B_DFLASH_DRAFTING = costs.Drafting(tau=4.01, num_drafts=7, drafter=costs.e4b_dflash_drafter(), passes=1,
                                     tokens_per_pass=8)
# Nemotron 3 Super with its MTP head: a window of T = 4 (3 drafts), as vLLM's Super benchmarks run it. The
# head (one attention and one MoE layer) is priced at 5% of a target step per pass and tau = 3 is a setting
# for the sliders to move, not a published figure.
SUPER_MTP_DRAFTING = costs.Drafting(tau=3.0, num_drafts=3, passes=3, draft_ratio=0.05)
CONTEXT = 2048  # tokens of context per request in the tables
THROUGHPUT_BATCH = 64  # the Bolt E4B write-up's throughput recipe: 64 sequences, no speculative decoding

# Measured, not modelled. The Super/Lightning paper: turning checkpoint + replay on (Super with its MTP head, one
# GB200, its agent workload with a floor of 50 tokens/s per user) raised total throughput by 4.7-6.4 % and the
# speed per user by 6.4-12.5 %. vLLM PR #47576 (ReplaySSM): Nemotron 3 Super, MTP drafts, T = 4, on a B300,
# replay over per-position states 1.88x the speculative throughput at batch 256.
PAPER_REPLAY_GAIN_PERCENT = {"total throughput": (4.7, 6.4), "speed per user": (6.4, 12.5)}
VLLM_REPLAY_OVER_NATIVE_AT_256 = 1.88


def measure_step_seconds(model, batches=(1, 4, 16), context_len: int = 32, num_drafts: int = 7,
                         repeats: int = 3) -> dict[int, tuple[float, float]]:
    """batch -> (seconds of a decode step, seconds of a verify forward over K + 1 tokens), on this machine.

    Each forward runs after a prefilled context of `context_len` tokens, through the adapter the decoding
    loops use, and is rolled back after it so every repeat sees the same cache (`bench.timing.timed`).
    """
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = {}
    for batch in batches:
        target = target_adapter(model)
        prompts = torch.randint(3, vocab, (batch, context_len), generator=g)
        target.prefill(as_prompt_batch(prompts, model.generation_config.pad_token_id or 0))
        seconds = []
        for n in (1, num_drafts + 1):
            tokens = torch.randint(3, vocab, (batch, n), generator=g)

            def step(target=target, tokens=tokens, n=n, batch=batch):
                target.forward(tokens)
                target.rollback(torch.zeros(batch, dtype=torch.long), n)

            seconds.append(timed(step, repeats)[0])
        out[batch] = (seconds[0], seconds[1])
    return out


def speedup_curves(batches=tuple(2**i for i in range(11)), context_len: int = CONTEXT) -> dict[str, list[float]]:
    """Speedup of speculative decoding by batch for E4B + DFlash and Super + MTP (both Mamba strategies)."""
    curves = {}
    for hw in (costs.H200, costs.B200):
        curves[f"E4B + DFlash, {hw.name}"] = [
            costs.speedup_at_batch(costs.E4B_TARGET, hw, b, E4B_DFLASH_DRAFTING, context_len) for b in batches]
        for strategy in ("per-position", "replay"):
            curves[f"Super + MTP ({strategy}), {hw.name}"] = [
                costs.speedup_at_batch(costs.super_target(strategy), hw, b, SUPER_MTP_DRAFTING, context_len)
                for b in batches]
    return curves


def plot_speedup(measured: dict[int, tuple[float, float]] | None = None, tau_measured: float = 3.0):
    """Speedup by batch (log x) in two panels, because the two kinds of target move in opposite directions:
    (a) dense Bolt E4B + DFlash, falling from ~tau to below 1, with the measured CPU points if given;
    (b) the mixture of experts Nemotron 3 Super + MTP, below 1 at batch 1 and rising until it turns compute-bound.
    A dotted line marks the write-up's 64-sequence throughput setup."""
    import matplotlib.pyplot as plt

    batches = tuple(2**i for i in range(11))
    curves = speedup_curves(batches)
    fig, (dense, moe) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True, layout="constrained")
    plt.close(fig)
    for label, ys in curves.items():
        ax = dense if label.startswith("E4B") else moe
        color = PALETTE[0] if label.startswith("E4B") else PALETTE[2] if "replay" in label else PALETTE[1]
        ax.plot(batches, ys, "--" if "B200" in label else "-", color=color, label=label)
    if measured:
        xs = sorted(measured)
        dense.plot(xs, [costs.speedup(tau_measured, measured[b][0], 0.0, measured[b][1]) for b in xs], "ko-",
                   label=f"bolt-mini on this CPU (measured, tau = {tau_measured}, free drafts)")
    dense.set_title("(a) dense target: the gain falls with the batch")
    moe.set_title("(b) mixture of experts: the gain rises with the batch\n"
                  "until compute or Mamba state traffic takes over")
    for ax in (dense, moe):
        ax.axhline(1, color="grey", lw=1)
        ax.axvline(THROUGHPUT_BATCH, color="grey", lw=1, ls=":")
        ax.set(xscale="log", xlabel="batch (sequences decoded together)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    dense.set_ylabel("speedup over plain decoding (model)")
    return fig


def e4b_margin(batch: int = THROUGHPUT_BATCH, hw: costs.Accelerator = costs.H200,
               context_len: int = CONTEXT) -> dict:
    """What the roofline gives Bolt E4B + DFlash at one batch: the three costs, the speedup, the tau at which
    speculation would only break even, and the batch at which it stops paying."""
    d = E4B_DFLASH_DRAFTING
    c_t = costs.forward_seconds(costs.E4B_TARGET, hw, batch, 1, context_len)
    c_v = costs.forward_seconds(costs.E4B_TARGET, hw, batch, d.num_drafts + 1, context_len)
    c_d = costs.forward_seconds(d.drafter, hw, batch, d.tokens_per_pass, context_len)
    return {"gpu": hw.name, "batch": batch, "C_t_ms": round(c_t * 1e3, 2), "C_d_ms": round(c_d * 1e3, 2),
            "C_v_ms": round(c_v * 1e3, 2), "cycle_in_decode_steps": round((c_d + c_v) / c_t, 2),
            "speedup": round(costs.speedup(d.tau, c_t, c_d, c_v), 2),
            "break_even_tau": round(costs.break_even_tau(c_t, c_d, c_v), 2),
            "stops_paying_at": costs.break_even_batch(costs.E4B_TARGET, hw, d, context_len)}


def expert_reads(batches=(1, 4, 16, 64, 256)) -> list[dict]:
    """Share of Nemotron 3 Super's weights one forward reads, a decode step against a verify forward over T = 4
    tokens per sequence (the model's independent routing: an upper bound for a small forward)."""
    sup, window = costs.super_target(), SUPER_MTP_DRAFTING.num_drafts + 1
    return [{"batch": b, "decode_step_reads_%": round(100 * sup.weight_bytes_read(b) / sup.weight_bytes, 1),
             "verify_reads_%": round(100 * sup.weight_bytes_read(b * window) / sup.weight_bytes, 1)}
            for b in batches]


def replay_gain_rows(batches=(1, 4, 8, 16, 32, 64, 128, 256), hw: costs.Accelerator = costs.B200,
                     context_len: int = CONTEXT) -> list[dict]:
    """Checkpoint + replay against per-position states for Super + MTP, by batch, as the roofline prices them:
    the two speedups, replay's gain in throughput (the same batch, so the same gain per user), and the share of
    a per-position verify forward's bytes that is Mamba state (what replay cuts)."""
    native, replay = costs.super_target(), costs.super_target("replay")
    window = SUPER_MTP_DRAFTING.num_drafts + 1
    rows = []
    for b in batches:
        s_native = costs.speedup_at_batch(native, hw, b, SUPER_MTP_DRAFTING, context_len)
        s_replay = costs.speedup_at_batch(replay, hw, b, SUPER_MTP_DRAFTING, context_len)
        state = b * native.state_traffic(window)
        rows.append({"batch": b, "per_position": round(s_native, 2), "replay": round(s_replay, 2),
                     "replay_gain_%": round(100 * (s_replay / s_native - 1), 1),
                     "state_share_of_verify_bytes_%":
                         round(100 * state / (state + native.weight_bytes_read(b * window)), 1)})
    return rows


def memory_rows(context_len: int = CONTEXT) -> list[dict]:
    """Memory per request and requests that fit one GPU, for each deployment."""
    drafter = costs.e4b_dflash_drafter()
    e4b, sup, sup_replay = costs.E4B_TARGET, costs.super_target(), costs.super_target("replay")
    setups = [
        ("E4B, plain", e4b, None, 1, e4b.weight_bytes),
        ("E4B + DFlash drafter", e4b, drafter, 1, e4b.weight_bytes + drafter.weight_bytes),
        ("Super, plain", sup, None, 1, sup.weight_bytes),
        ("Super + MTP, per-position states", sup, None, 4, sup.weight_bytes),
        ("Super + MTP, checkpoint + replay", sup_replay, None, 4, sup.weight_bytes),
    ]
    rows = []
    for name, target, draft, window, weights in setups:
        per_request = costs.memory_per_request(target, context_len, draft, spec_window=window)
        rows.append({"deployment": name, "weights_GB": round(costs.to_gb(weights), 1),
                     "per_request_MiB": round(costs.to_mib(per_request), 1),
                     **{f"fit_{hw.name}": costs.requests_that_fit(hw, weights, per_request)
                        for hw in (costs.H200, costs.B200)}})
    return rows


def deployment_table(context_len: int = CONTEXT) -> list[dict]:
    """Which technique pays in which deployment: speedup at batch 1 (latency) and 64 (throughput), the batch
    where it stops paying, on H200."""
    hw = costs.H200
    setups = [("E4B + DFlash", costs.E4B_TARGET, E4B_DFLASH_DRAFTING),
              ("Super + MTP, per-position", costs.super_target(), SUPER_MTP_DRAFTING),
              ("Super + MTP, replay", costs.super_target("replay"), SUPER_MTP_DRAFTING)]
    rows = []
    for name, target, drafting in setups:
        rows.append({"technique": name,
                     "speedup_b1": round(costs.speedup_at_batch(target, hw, 1, drafting, context_len), 2),
                     "speedup_b64": round(costs.speedup_at_batch(target, hw, 64, drafting, context_len), 2),
                     "stops_paying_at": costs.break_even_batch(target, hw, drafting, context_len)})
    return rows


def sliders():
    """Batch, tau, drafter cost and context length -> speedup and memory for E4B + DFlash and Super + MTP."""
    import ipywidgets as w
    from IPython.display import display

    batch = w.IntSlider(value=1, min=1, max=512, description="batch")
    tau = w.FloatSlider(value=4.0, min=1.0, max=8.0, step=0.05, description="tau (E4B)")
    draft = w.FloatSlider(value=0.05, min=0.0, max=0.5, step=0.01, description="MTP pass cost")
    context = w.IntSlider(value=CONTEXT, min=128, max=32768, step=128, description="context")
    out = w.Output()

    def show(_=None):
        e4b = costs.Drafting(tau=min(tau.value, 8.0), num_drafts=7, drafter=E4B_DFLASH_DRAFTING.drafter,
                             passes=1, tokens_per_pass=8)
        mtp = costs.Drafting(tau=min(tau.value, 4.0), num_drafts=3, passes=3, draft_ratio=draft.value)
        lines = []
        for hw in (costs.H200, costs.B200):
            s_e4b = costs.speedup_at_batch(costs.E4B_TARGET, hw, batch.value, e4b, context.value)
            s_sup = costs.speedup_at_batch(costs.super_target("replay"), hw, batch.value, mtp, context.value)
            lines.append(f"{hw.name}: E4B + DFlash {s_e4b:.2f}x   Super + MTP (replay, tau capped at 4) {s_sup:.2f}x")
        per = costs.memory_per_request(costs.E4B_TARGET, context.value, E4B_DFLASH_DRAFTING.drafter)
        lines.append(f"E4B + DFlash memory per request: {costs.to_mib(per):.0f} MiB; fit on H200: "
                     f"{costs.requests_that_fit(costs.H200, costs.E4B_TARGET.weight_bytes, per)}")
        out.clear_output()
        with out:
            print("\n".join(lines))

    for s in (batch, tau, draft, context):
        s.observe(show, names="value")
    show()
    display(w.VBox([batch, tau, draft, context, out]))
