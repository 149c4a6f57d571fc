"""4-bit weights kept packed end to end: format reference, FP4Linear, matmul dispatch, loader, LoRA, quantization.

Light on import (torch only); the loader (transformers), LoRA (peft) and compress (llmcompressor) modules import
their libraries when used, so this package imports on a GPU image with only torch + transformers + peft + triton.
"""
from qerl.quant.format import dequantize, dequantize_mxfp4, dequantize_nvfp4, quantize_nvfp4
from qerl.quant.dispatch import fp4_matmul, fp4_matmul_t
from qerl.quant.linear import FP4Linear

__all__ = ["FP4Linear", "dequantize", "dequantize_mxfp4", "dequantize_nvfp4", "fp4_matmul", "fp4_matmul_t",
           "quantize_nvfp4"]
