"""Mamba-2 and the Nemotron-H hybrid: the mixer (recurrent and chunked), state handling, checkpoint + replay.

    mamba2   the Mamba-2 mixer reference (step recurrence + chunked SSD), equal to transformers' NemotronH mixer
    replay   per-position states vs checkpoint + replay behind one store interface (+ Triton verify / flush)
    hybrid   HybridLM: lightning-mini's own forward and cache; HybridTarget for the speculative loop
    bench    `python -m minispec.bench replay`
"""
