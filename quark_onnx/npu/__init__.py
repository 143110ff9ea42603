"""What the NPU accepts (XINT8), in one place.

* :mod:`~quark_onnx.npu.ops`: one row per op type: its quantization policy and NPU facts;
  :mod:`~quark_onnx.npu.policy` (the planner's view of a row) and :mod:`~quark_onnx.npu.op_sets`
  (the op sets derived from the table) read it;
* :mod:`~quark_onnx.npu.rules`: one :class:`~quark_onnx.npu.rules.Rule` per rule id, used alike by
  the position solver (:mod:`quark_onnx.params.solver`) and the readiness check;
* :mod:`~quark_onnx.npu.readiness`: :func:`check` reads positions from a written Q/DQ model and
  checks them (:mod:`~quark_onnx.npu.structure`: the model-level findings;
  :mod:`~quark_onnx.npu.findings`: what is reported); :mod:`~quark_onnx.npu.costs`: what the rules
  cost in SQNR; :mod:`~quark_onnx.npu.placement`: where a node runs.
"""
