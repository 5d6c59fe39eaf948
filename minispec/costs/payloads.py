"""Weight payloads: ideal 4-bit codes, NVFP4 bits per parameter, a BF16 embedding copy."""

from __future__ import annotations

from minispec.costs.units import BF16_BYTES, check_nonnegative, check_positive, check_positive_int


def nvfp4_bits_per_param(block_size: int = 16, *, code_bits: int = 4, scale_bits: int = 8) -> float:
    """Storage bits per NVFP4 element (the two-level NVFP4 format of NVIDIA Model Optimizer).

    A 4-bit E2M1 code per element plus one 8-bit E4M3 scale per block of 16:
    4 + 8/16 = 4.5 bits (ModelOpt's ``effective_bits: 4.5``). The FP32 per-tensor scale adds
    32 bits per *tensor*, i.e. nothing measurable per parameter, so it is left out.
    """
    check_positive_int(block_size=block_size, code_bits=code_bits, scale_bits=scale_bits)
    return code_bits + scale_bits / block_size


def ideal_4bit_code_bytes(n_params: int) -> float:
    """Bytes of bare 4-bit codes: n_params · 4 bits / 8, with no block scales.

    The floor any 4-bit format approaches. Bolt E4B's drafter: 1,031,568,640 / 2 = 515,784,320 B
    = 491.9 MiB; its head alone 671,088,640 / 2 B = 320 MiB.
    """
    check_nonnegative(n_params=n_params)
    return n_params * 4 / 8


def nvfp4_bytes(n_params: int, block_size: int = 16) -> float:
    """Bytes of NVFP4 codes plus their E4M3 block scales: n_params · 4.5 bits / 8."""
    check_nonnegative(n_params=n_params)
    return n_params * nvfp4_bits_per_param(block_size) / 8


def embedding_bytes(vocab_size: int, hidden_size: int, bytes_per_element: float = BF16_BYTES) -> float:
    """Bytes of one vocab × hidden matrix (an embedding table or an output head).

    A BF16 copy of Bolt E4B's 262,144 × 2560 embedding: 262,144 · 2560 · 2 B
    = 1,342,177,280 B = 1.25 GiB, which is what a drafter saves by sharing the target's.
    """
    check_positive_int(vocab_size=vocab_size, hidden_size=hidden_size)
    check_positive(bytes_per_element=bytes_per_element)
    return vocab_size * hidden_size * bytes_per_element
