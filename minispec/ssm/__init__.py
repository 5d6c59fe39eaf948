"""Mamba-2: the mixer (recurrent and chunked), state handling, checkpoint + replay."""
