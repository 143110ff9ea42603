"""Test models built from onnx.helper and numpy, and the measures that judge them."""
