"""Mamba-2 and the Nemotron-H hybrid: the SSD math, the mixer, its state, checkpoint + replay, the hybrid model.

    ssd      the SSD math (Dao & Gu 2024): discretisation, step recurrence, chunked scan, causal conv, gated norm
    config   Mamba2Config: the mixer's sizes and numerics, to and from transformers' NemotronHConfig
    state    Mamba2State: the conv window and SSM state of one layer, their checks, transformers' conv layout
    mamba2   Mamba2Mixer, equal to transformers' NemotronH mixer (chunked scan for prefill, recurrence for steps)
    replay   per-position states vs checkpoint + replay behind one store interface (+ Triton verify / flush)
    hybrid   HybridLM: lightning-mini's own forward and cache; HybridTarget for both decoding loops

Its benchmark is `python -m minispec.bench replay` (minispec/bench/replay.py).
"""
