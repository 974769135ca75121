"""A decoder at lower precision, as users make one with ONNX Runtime's own tools.

Each function reads an fp32 ONNX model and writes another beside it; tierflow plans, serves
and generates with the result like any model, its memory counted in the bytes its weights
really take (int8: one byte a weight, fp16 two, 4-bit half a byte plus a scale a block).

- :func:`quantize_int8`: ``onnxruntime.quantization.quantize_dynamic``, int8 weights,
  activations quantized per request (DynamicQuantizeLinear + MatMulInteger);
- :func:`quantize_int4`: weight-only 4-bit ``MatMulNBits``
  (``onnxruntime.quantization.matmul_nbits_quantizer``), blocks of ``block_size`` weights
  sharing a scale;
- :func:`to_fp16`: every float tensor in half precision, inputs, outputs and KV cache
  included (``onnxruntime.transformers.float16``), as an fp16 export has them.

Weights stay inside the file (these are for models under 2 GB).
"""

from __future__ import annotations

from pathlib import Path

PRECISIONS = ("int8", "int4", "fp16")


def quantize_int8(src: str | Path, dst: str | Path) -> Path:
    """int8 weights by ``quantize_dynamic`` (ONNX Runtime's dynamic quantization)."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    # It suggests its pre-processing on every call (a warning on the root logger).
    previous = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        quantize_dynamic(Path(src), Path(dst), weight_type=QuantType.QInt8)
    finally:
        logging.getLogger().setLevel(previous)
    return Path(dst)


def quantize_int4(src: str | Path, dst: str | Path, *, block_size: int = 32) -> Path:
    """Weight-only 4-bit ``MatMulNBits`` for every MatMul with a constant weight."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), block_size=block_size, is_symmetric=True)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=False)
    return Path(dst)


def to_fp16(src: str | Path, dst: str | Path) -> Path:
    """Every float tensor in fp16, the model's inputs, outputs and KV cache included."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=False)
    onnx.save(model, str(dst))
    return Path(dst)


def convert(src: str | Path, dst: str | Path, precision: str) -> Path:
    """``src`` at ``precision`` (one of :data:`PRECISIONS`) written to ``dst``."""
    if precision == "int8":
        return quantize_int8(src, dst)
    if precision == "int4":
        return quantize_int4(src, dst)
    if precision == "fp16":
        return to_fp16(src, dst)
    raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
