"""Model-level readiness findings: the structure the Vitis AI EP needs, before any op."""

from __future__ import annotations

import onnx_ir as ir

from quark_onnx.npu import rules
from quark_onnx.npu.findings import Finding, node_label

_STANDARD_DOMAINS = ("", "ai.onnx")
_CONTROL_FLOW = frozenset({"Loop", "If", "Scan"})
_CONV_ATTRIBUTES = ("kernel_shape", "strides", "pads", "dilations", "group")


def model_findings(
    graph: ir.Graph, label: str, nodes: list[ir.Node], has_qdq: bool
) -> list[Finding]:
    """The model-level findings: not quantized, dynamic shapes, batch size, control flow, too few
    Conv nodes, Conv attributes left to their defaults, Conv kernels above the NPU's limit."""
    findings: list[Finding] = []

    def add(rule: str, node: str | None, message: str) -> None:
        findings.append(Finding(rule, node, message))

    if not has_qdq:
        computing = sum(1 for n in nodes if n.op_type not in ("Constant",))
        add(
            "not_quantized",
            None,
            f"model {label!r} is not quantized: it has no QuantizeLinear/"
            f"DequantizeLinear nodes, so its {computing} float nodes would run on the CPU; "
            "quantize it with the XINT8 configuration (quark_onnx.ModelQuantizer with "
            "get_default_config('XINT8'))",
        )
    for value in graph.inputs:
        if value.is_initializer():
            continue
        shape = value.shape
        if shape is None:
            add(
                "dynamic_shape",
                value.name,
                f"graph input {value.name!r} has no shape; the NPU compiles static shapes "
                "only: give the input a fixed shape (batch 1)",
            )
            continue
        dims = list(shape.dims)
        loose = [i for i, d in enumerate(dims) if not isinstance(d, int)]
        if loose:
            shown = ["?" if getattr(d, "value", d) is None else str(d) for d in dims]
            add(
                "dynamic_shape",
                value.name,
                f"graph input {value.name!r} has shape [{', '.join(shown)}] with symbolic or "
                f"unknown dims at axes {loose}; the NPU compiles static shapes only: "
                f"quantize with the FixShapes option (--set FixShapes='{value.name}:[1,...]' "
                "with batch 1), or calibrate on data of one shape, which the CLI fixes for NPU "
                "presets (an image spec of one size: resize=height,size=32x320 for a text "
                "recognizer, not size=32)",
            )
        if len(dims) >= 2 and isinstance(dims[0], int) and dims[0] > 1:
            add(
                "batch_size",
                value.name,
                f"graph input {value.name!r} has batch size {dims[0]} (shape "
                f"{[d if isinstance(d, int) else str(d) for d in dims]}); the NPU runs batch "
                "1 only: export the model with batch 1",
            )
    conv_count = 0
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.op_type in _CONTROL_FLOW and node.domain in _STANDARD_DOMAINS:
            add(
                "control_flow",
                node_label(node),
                f"{node.op_type} node {node_label(node)!r}: control flow (Loop/If/Scan) is not "
                "compiled for the NPU (an If with data-dependent shapes aborts Vitis AI EP "
                "session creation); unroll or fold it, or split the model at that node",
            )
        if node.op_type == "Conv" and node.domain in _STANDARD_DOMAINS:
            conv_count += 1
    if conv_count < rules.MIN_CONV_NODES:
        add(
            "too_few_conv",
            None,
            f"model {label!r} has {conv_count} Conv node(s); the Vitis AI EP compiles a "
            f"model for the NPU only with at least {rules.MIN_CONV_NODES} Conv nodes "
            "(XLNX_MINIMUM_NUM_OF_CONV), otherwise everything runs on the CPU",
        )
    for node in nodes:
        if node.op_type != "Conv" or node.domain not in _STANDARD_DOMAINS:
            continue
        if len(node.inputs) < 2:
            continue
        missing = [a for a in _CONV_ATTRIBUTES if a not in node.attributes]
        if missing:
            add(
                "conv_default_attributes",
                node_label(node),
                f"Conv {node_label(node)!r} relies on ONNX defaults for {', '.join(missing)}; the "
                "Vitis AI EP aborts session creation on such a Conv: write all of "
                "kernel_shape, strides, pads, dilations, group explicitly (pass "
                "MakeConvAttributesExplicit, or onnxsim.legalize_for_vitisai)",
            )
        kernel = _conv_kernel(node)
        if kernel is not None and max(kernel) > rules.MAX_CONV_KERNEL_SIDE:
            kind = "depthwise Conv" if _depthwise(node) else "Conv"
            add(
                "conv_kernel_size",
                node_label(node),
                f"{kind} {node_label(node)!r} has kernel {'x'.join(map(str, kernel))}; the NPU "
                f"compiles Conv kernels (depthwise included) of at most "
                f"{rules.MAX_CONV_KERNEL_SIDE} per side: split the kernel, or for a mean over "
                "a window keep it an average pool",
            )
    return findings


def _conv_kernel(node: ir.Node) -> tuple[int, ...] | None:
    """The Conv's kernel sides: its ``kernel_shape``, else the weight's spatial dims."""
    written = node.attributes.get_ints("kernel_shape", None)
    if written is not None:
        return tuple(int(k) for k in written)
    weight = node.inputs[1]
    if weight is None or weight.shape is None or weight.shape.rank() < 3:
        return None
    dims = tuple(weight.shape[2:])
    return tuple(int(d) for d in dims) if all(isinstance(d, int) for d in dims) else None


def _depthwise(node: ir.Node) -> bool:
    group = node.attributes.get_int("group", 1)
    weight = node.inputs[1]
    return group > 1 and weight is not None and weight.shape is not None and weight.shape[1] == 1
