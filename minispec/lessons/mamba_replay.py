"""Pictures for notebook 05: a Mamba layer's buffer and state traffic, step by step, naive vs replay."""
from __future__ import annotations

import matplotlib.pyplot as plt

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
