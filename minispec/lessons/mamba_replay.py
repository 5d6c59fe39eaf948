"""Pictures for notebook 05: a Mamba layer's buffer and state traffic, step by step, naive vs replay; and
what each kernel of the chunked SSD scan computes."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import torch

from minispec.ssm.replay import MambaLayerStore
from minispec.viz.plots import PALETTE


def step_log(store: MambaLayerStore) -> list[dict]:
    """One row per verify step of a store: the ring fill before it, window T, tokens kept, drafts
    rejected, whether a flush ran first, and the state bytes written / read by the step (flush included)."""
    rows, flushed, extra_w, extra_r = [], False, 0, 0
    events = store.traffic.events
    for i, e in enumerate(events):
        if e.kind == "flush":
            flushed, extra_w, extra_r = True, e.written, e.read
        elif e.kind == "verify":
            kept = next((f.tokens for f in events[i + 1:] if f.kind == "commit"), 0)
            rows.append({"step": len(rows) + 1, "window": e.tokens, "kept": kept, "rejected": e.tokens - kept,
                         "flushed": flushed, "written": e.written + extra_w, "read": e.read + extra_r})
            flushed, extra_w, extra_r = False, 0, 0
    fill = 0
    capacity = getattr(store, "capacity", None)
    for r in rows:
        if capacity is not None:
            if r["flushed"]:
                fill = 0
            r["fill_before"] = fill
            fill += r["kept"]
            r["fill_after"] = fill
    return rows


def replay_timeline(replay_rows: list[dict], naive_rows: list[dict], capacity: int, title: str = ""):
    """Two panels over the verify steps: the replay ring (kept records, rejected drafts, flushes) and
    the state bytes each step writes, per-position states vs checkpoint + replay (log scale)."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, layout="constrained")
    plt.close(fig)
    steps = [r["step"] for r in replay_rows]
    top.bar(steps, [r["fill_before"] for r in replay_rows], color="#BBBBBB", label="records already in the ring")
    top.bar(steps, [r["kept"] for r in replay_rows], bottom=[r["fill_before"] for r in replay_rows],
            color=PALETTE[2], label="kept this step")
    top.bar(steps, [r["rejected"] for r in replay_rows], bottom=[r["fill_after"] for r in replay_rows],
            color=PALETTE[3], alpha=0.45, label="rejected (counter not moved)")
    flushes = [r["step"] for r in replay_rows if r["flushed"]]
    for i, s in enumerate(flushes):
        top.axvline(s - 0.5, color=PALETTE[0], lw=1.5, label="flush (checkpoint written)" if i == 0 else None)
    top.axhline(capacity, color="black", lw=0.8, ls=":")
    top.set_ylabel("ring records")
    top.set_title(title or f"checkpoint + replay, ring of {capacity}")
    top.legend(frameon=False, fontsize=8, ncols=2, loc="upper left")
    top.set_ylim(0, capacity * 1.6)
    bottom.plot([r["step"] for r in naive_rows], [r["written"] / 1024 for r in naive_rows], "o-", ms=3,
                color=PALETTE[1], label="per-position states")
    bottom.plot(steps, [r["written"] / 1024 for r in replay_rows], "o-", ms=3, color=PALETTE[0],
                label="checkpoint + replay")
    bottom.set_yscale("log")
    bottom.set_ylabel("state KiB written (log)")
    bottom.set_xlabel("verify step")
    bottom.legend(frameon=False, fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)
    return fig


def ssd_pipeline_figure(x, dt, A, B, C, stages: dict, chunk_size: int, head: int = 0, channel: int = 0):
    """What each kernel of the chunked SSD scan computes, for one sequence and one head.

    x [1, T, H, P], dt [1, T, H], A [H], B, C [1, T, G, N]: the scan's inputs; stages: what
    `minispec.kernels.ssd.ssd_stages(..., keep_y_local=True)` returned for them. Three panels:
    (a) the whole T x T map of token s's weight in y_t, (C_t . B_s) exp(cum_t - cum_s) dt_s: kernel 3
        computes the blocks on the diagonal (inside a chunk), the states carry everything below them;
    (b) |S_c| of each chunk's own state (kernel 1) and |h_c| of the state entering it (kernel 2);
    (c) one channel of y: the intra-chunk part (kernel 3), the entering state's part (kernel 4) and their sum.
    """
    T, H = x.shape[1], x.shape[2]
    Bh, Ch = B[0].repeat_interleave(H // B.shape[2], dim=1), C[0].repeat_interleave(H // C.shape[2], dim=1)
    log_a = (dt[0, :, head] * A[head]).double()
    cum = log_a.cumsum(0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    decay = torch.exp((cum[:, None] - cum[None, :]).masked_fill(~causal, -math.inf))
    weights = (Ch[:, head].double() @ Bh[:, head].double().T) * decay * dt[0, :, head].double()[None, :]

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 4), layout="constrained")
    plt.close(fig)
    limit = weights.abs().max().item()
    a.imshow(weights.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit)
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        a.add_patch(plt.Rectangle((start - 0.5, start - 0.5), end - start, end - start, fill=False,
                                  edgecolor="black", lw=1.2))
    a.set_title("(a) weight of token s in y_t\nboxes: kernel 3 (inside a chunk)", fontsize=10)
    a.set_xlabel("s (source token)")
    a.set_ylabel("t (output token)")

    chunks = range(stages["chunk_states"].shape[1])
    own = stages["chunk_states"][0, :, head].flatten(1).norm(dim=1)
    entering = stages["entering_states"][0, :, head].flatten(1).norm(dim=1)
    width = 0.4
    b.bar([i - width / 2 for i in chunks], own.tolist(), width, color=PALETTE[2],
          label="S_c: built in chunk c (kernel 1)")
    b.bar([i + width / 2 for i in chunks], entering.tolist(), width, color=PALETTE[0],
          label="h_c: entering chunk c (kernel 2)")
    b.set_title("(b) chunk states and the states passed along", fontsize=10)
    b.set_xlabel("chunk c")
    b.set_ylabel("Frobenius norm")
    b.legend(frameon=False, fontsize=8)

    t = range(T)
    local = stages["y_local"][0, :, head, channel]
    total = stages["y"][0, :, head, channel]
    c.plot(t, local.tolist(), color=PALETTE[2], lw=1.2, label="intra-chunk part (kernel 3)")
    c.plot(t, (total - local).tolist(), color=PALETTE[0], lw=1.2, label="entering state + D x (kernel 4)")
    c.plot(t, total.tolist(), color="black", lw=1.8, label="y = their sum")
    for start in range(chunk_size, T, chunk_size):
        c.axvline(start - 0.5, color="#BBBBBB", lw=0.8, ls=":")
    c.set_title(f"(c) one channel of y (head {head}, channel {channel})", fontsize=10)
    c.set_xlabel("token t")
    c.legend(frameon=False, fontsize=8)
    for ax in (b, c):
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)
    return fig
