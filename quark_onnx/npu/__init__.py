"""The NPU's XINT8 rules in one place.

* :mod:`~quark_onnx.npu.ops`: one row per op type: its quantization policy and NPU facts;
* :mod:`~quark_onnx.npu.rules`: one :class:`~quark_onnx.npu.rules.Rule` per rule id;
* :mod:`~quark_onnx.npu.solver`: moves positions until every enabled rule holds;
  :mod:`~quark_onnx.npu.verify` recomputes the rules from a plan and its positions;
* :mod:`~quark_onnx.npu.readiness`: reads positions from a written Q/DQ model and checks them
  (:mod:`~quark_onnx.npu.structure`: the model-level findings; :mod:`~quark_onnx.npu.findings`:
  what is reported).
"""
