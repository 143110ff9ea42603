"""Files other than the ONNX model itself: written, read back, imported, exported.

``recipe`` and ``recipe_format`` (save a quantization, rebuild it), ``safetensors_io``,
``importer`` and ``qdq_reader`` (a QDQ model back to a float model and parameters),
``gguf_export`` and ``nbits_export`` (MatMulNBits).
"""
