"""Triton kernels, one module per component, each beside the PyTorch reference it must equal.

This folder is installed as `minispec.kernels` (pyproject's package-dir mapping): import it only
under that name. Never import it as a top-level `kernels`: that is the import name of Hugging
Face's `kernels` package, which transformers probes for and would then try to use.

minispec/backend.py imports these modules lazily, on first use, so `import minispec` never imports
triton, and TRITON_INTERPRET can still be switched on before any `@triton.jit` runs.
"""
