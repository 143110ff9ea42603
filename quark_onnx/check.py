"""Is a model ready for the Vitis AI / Ryzen AI NPU (XINT8)? If not, every reason why.

:func:`check` reads any ONNX model (a path or a ``ModelProto``; it is never modified) and returns a
:class:`CheckResult` holding one :class:`Finding` per problem. An empty list means "Vitis AI
ready". Each finding names the node or tensor, the values, the allowed range and the fix. What is
checked, and how positions are read from the Q/DQ graph, is documented in
:mod:`quark_onnx.npu.readiness`; the rules themselves in :mod:`quark_onnx.npu.rules`.
"""

from __future__ import annotations

import os
import sys
import types

import onnx

from quark_onnx.npu.findings import ADVISORY_RULES, CheckResult, Finding
from quark_onnx.npu.readiness import check

__all__ = ["ADVISORY_RULES", "CheckResult", "Finding", "check"]


class _CallableModule(types.ModuleType):
    """``quark_onnx.check(model)`` must work even after ``import quark_onnx.check``.

    Importing the submodule makes the package attribute ``quark_onnx.check`` this module (the
    import system sets it), shadowing the lazily exported function of the same name; calling the
    module forwards to :func:`check`.
    """

    def __call__(self, model: str | os.PathLike | onnx.ModelProto) -> CheckResult:
        return check(model)


sys.modules[__name__].__class__ = _CallableModule
