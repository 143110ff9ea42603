"""The pass framework: passes are ``onnx_ir`` in-place passes with typed options.

A pass is a small class whose constructor takes its (typed) options and whose ``call(model)``
returns ``onnx_ir.passes.PassResult(model, modified)``. Passes run alone from Python::

    from quark_onnx.passes import ConvertBNToConv
    result = ConvertBNToConv()(ir_model)   # result.model, result.modified

and are chained by :func:`quark_onnx.pipeline.prepare.prepare_passes`, which picks them from a
config.

Passes that change numerics on purpose set ``changes_numerics = True``; the pipeline then measures
what they did to the float outputs. Those that model the NPU's own arithmetic (the DPU versions of
LeakyRelu, HardSigmoid and average pooling) also set ``simulates_hardware = True``: their cost is
the hardware's, so it is reported but never a warning and never undone. A numerics-changing
pass replaces the tensors it changes instead of writing into them: the model before it is kept
as a clone that shares the tensors, to be measured (in one session with the model after it,
:mod:`quark_onnx.fidelity.paired_run`) and, when the pass costs too much, restored.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir


class QuarkPass(ir.passes.InPlacePass):
    """Base of every quark_onnx graph pass."""

    #: True for passes that deliberately change the float model's outputs (documented per pass).
    changes_numerics: ClassVar[bool] = False
    #: True for numerics-changing passes that reproduce what the NPU computes (not optional).
    simulates_hardware: ClassVar[bool] = False
