"""Graph-rewrite passes, one per module (installed as ``quark_onnx.passes``).

Each pass is an ``onnx_ir`` in-place pass with typed constructor options (see :mod:`.base`).
Classes are imported on first access so that importing this package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

from quark_onnx.passes.base import QuarkPass

# class name -> module in this package
_PASSES = {
    # float passes chosen by extra options (prepare stage)
    "SimplifyWithOnnxsim": "simplify_with_onnxsim",
    "ConvertBNToConv": "convert_bn_to_conv",
    "FoldConvAffine": "fold_conv_affine",
    "ReplaceClip6Relu": "replace_clip6_relu",
    "ConvertClipToRelu": "convert_clip_to_relu",
    "ConvertSigmoidToHardSigmoid": "convert_sigmoid_to_hard_sigmoid",
    "ConvertReduceMeanToGlobalAvgPool": "convert_reduce_mean_to_global_avg_pool",
    "SplitLargeKernelPool": "split_large_kernel_pool",
    "ConvertGlobalAvgPoolToDepthwiseConv": "convert_global_avg_pool_to_depthwise_conv",
    "ConvertSplitToSlice": "convert_split_to_slice",
    "RemoveInferenceDropout": "remove_inference_dropout",
    "RemoveIdentity": "remove_identity",
    "CrossLayerEqualization": "cross_layer_equalization",
    "FoldConstantChannels": "fold_constant_channels",
    "EqualizeGatedActivations": "equalize_gated_activations",
    "EqualizeResidualStreams": "equalize_residual_streams",
    "MigrateActivationOutliers": "migrate_activation_outliers",
    # hardware simulation and legalization
    "ConvertLeakyReluToDPUVersion": "convert_leaky_relu_to_dpu_version",
    "ConvertHardSigmoidToDPUVersion": "convert_hard_sigmoid_to_dpu_version",
    "ConvertAvgPoolToDPUVersion": "convert_avg_pool_to_dpu_version",
    "MakeConvAttributesExplicit": "make_conv_attributes_explicit",
    "FixInputShapes": "fix_input_shapes",
    # quantization
    "InsertQDQ": "insert_qdq",
    "DynamicMatMulInteger": "dynamic_matmul_integer",
    "ToMatMulNBits": "matmul_nbits",
}

__all__ = ["QuarkPass", *_PASSES]


def __getattr__(name: str) -> Any:
    if name in _PASSES:
        module = importlib.import_module(f"quark_onnx.passes.{_PASSES[name]}")
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quark_onnx.passes' has no attribute {name!r}")
