"""Notebook 06 (serving costs): the live CPU measurement, the speedup-by-batch figure, the sliders, and the
closing table of which technique pays in which deployment. Every number comes from `minispec.costs`."""
from __future__ import annotations

import torch

from minispec import costs
from minispec.bench.timing import timed
from minispec.speculative.batch import as_prompt_batch
from minispec.speculative.target import target_adapter

# Bolt E4B with its DFlash drafter: the Bolt E4B write-up's MT-Bench acceptance length 4.01 (greedy) over
# blocks of 8 (7 drafts), one drafter pass per cycle over the whole block.
E4B_DFLASH_DRAFTING = costs.Drafting(tau=4.01, num_drafts=7, drafter=costs.e4b_dflash_drafter(), passes=1,
                                     tokens_per_pass=8)
# Nemotron 3 Super with its MTP head: a window of T = 4 (3 drafts), as vLLM's Super benchmarks run it. The
# head (one attention and one MoE layer) is priced at 5% of a target step per pass and tau = 3 is a setting
# for the sliders to move, not a published figure.
SUPER_MTP_DRAFTING = costs.Drafting(tau=3.0, num_drafts=3, passes=3, draft_ratio=0.05)
CONTEXT = 2048  # tokens of context per request in the tables


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

            def step(tokens=tokens, n=n):
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
    """Speedup by batch (log x): the model's curves, and the measured CPU points if given."""
    import matplotlib.pyplot as plt

    batches = tuple(2**i for i in range(11))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, ys in speedup_curves(batches).items():
        ax.plot(batches, ys, "--" if "B200" in label else "-", label=label)
    if measured:
        xs = sorted(measured)
        ax.plot(xs, [costs.speedup(tau_measured, measured[b][0], 0.0, measured[b][1]) for b in xs], "ko-",
                label=f"bolt-mini on this CPU (measured, tau = {tau_measured}, free drafts)")
    ax.axhline(1, color="grey", lw=1)
    ax.set(xscale="log", xlabel="batch (sequences decoded together)", ylabel="speedup over plain decoding",
           title="Speculative decoding pays less as the batch grows")
    ax.legend(fontsize=8)
    return fig


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
