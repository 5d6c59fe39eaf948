"""DFlash: block-parallel drafting conditioned on tapped target hidden states."""
