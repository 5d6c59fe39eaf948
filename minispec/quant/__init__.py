"""NVFP4 quantization: the format, calibration, sensitivity, recipes and QAD."""
