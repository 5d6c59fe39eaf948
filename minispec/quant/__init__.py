"""NVFP4 quantization: the format, calibration, sensitivity, recipes and QAD.

    import minispec as ms
    from minispec import quant
    model, _ = ms.load_target("bolt-mini")
    quant.quantize(model, quant.AGGRESSIVE)          # in place, like Model Optimizer's mtq.quantize
    quant.storage_report(model)["bits_per_param"]
    quant.quantized_weights(model)                   # the Parameters QAD trains
"""
from minispec.quant.api import (
    AGGRESSIVE,
    AGGRESSIVE_HEAD_BF16,
    AGGRESSIVE_HEAD_BF16_4O6,
    AGGRESSIVE_W4A4,
    ALGORITHMS,
    ALL_FP8,
    LIGHTNING_LIKE,
    SCALES_OF,
    SUPER_TIERS,
    assign_formats,
    check_recipe,
    formats_of,
    load_recipe,
    packed_state,
    param_formats,
    params_by_format,
    quantizable_modules,
    quantize,
    quantized_weights,
    save_recipe,
    storage_report,
)
from minispec.quant.modules import FORMATS, PackedLinear, QuantExperts, QuantLinear

__all__ = ["AGGRESSIVE", "AGGRESSIVE_HEAD_BF16", "AGGRESSIVE_HEAD_BF16_4O6", "AGGRESSIVE_W4A4", "ALGORITHMS",
           "ALL_FP8", "FORMATS", "LIGHTNING_LIKE", "SCALES_OF", "SUPER_TIERS", "PackedLinear", "QuantExperts",
           "QuantLinear", "assign_formats", "check_recipe", "formats_of", "load_recipe", "packed_state",
           "param_formats", "params_by_format", "quantizable_modules", "quantize", "quantized_weights", "save_recipe",
           "storage_report"]
