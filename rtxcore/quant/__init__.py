"""Post-training quantization of a whole model: calibration, per-layer error tracking with fallback, and the
quantized checkpoint (``rtx quantize``). The methods themselves are quantizer plugins."""
