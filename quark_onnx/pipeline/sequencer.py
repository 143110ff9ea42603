"""The order of the quantization pipeline, written once.

::

    load -> prepare -> plan -> parameters -> insert Q/DQ -> accuracy -> measure -> finalize
         -> check -> save

:func:`run` calls the stages of a :class:`Stages` object in that order; the two users differ only
in what some stages do:

* :class:`~quark_onnx.pipeline.quantizer.ModelQuantizer` (``quantize_model``): the parameters
  come from calibration (power-of-two positions solved against the NPU rules, or float scales), the
  accuracy stages (AdaRound, bias correction) change codes and return the parameters the model
  then holds, ``measure`` runs the per-layer error analysis and the fidelity guard, and the model
  is checked and saved;
* :func:`quark_onnx.formats.recipe.rebuild`: the parameters come from a recipe, there is no plan, no
  accuracy stage and no measurement (the recipe's codes already hold their effect).

One ``ir.Model`` goes from ``load`` to ``finalize``; :func:`run` holds the only reference the
pipeline keeps to it and drops it once the final ``ModelProto`` exists, so that the check and the
save do not hold two forms of the model at once (:meth:`Stages.release` drops what a stage kept,
before finalize).

A stage that runs longer than a few seconds is announced while it runs and timed when it ends
(:class:`~quark_onnx.runtime.progress.StageLine`, as :attr:`Stages.progress` says), except the
parameters, whose calibration reports its own progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import TYPE_CHECKING, Any

from quark_onnx.runtime import memory
from quark_onnx.runtime.progress import StageLine

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

    from quark_onnx.params.qparams import QuantParams

__all__ = ["Outcome", "Stages", "run"]


@dataclasses.dataclass
class Outcome:
    """What a run produced: the quantized model and the parameters it holds (tensor name ->
    :class:`~quark_onnx.params.qparams.QuantParams`, in the order written; codes after the accuracy
    stages)."""

    model: onnx.ModelProto
    params: dict[str, QuantParams]


class Stages:
    """The stages of one run. :meth:`load`, :meth:`parameters` and :meth:`finalize` must be given;
    the others do nothing by default."""

    #: the stage lines: ``None`` (lines on a terminal, INFO records elsewhere) or ``False``
    #: (none); anything else (a calibration progress callback) counts as ``None``
    progress: Any = None

    def load(self) -> ir.Model:
        """The float model to quantize (the pipeline changes it in place)."""
        raise NotImplementedError

    def prepare(self, model: ir.Model) -> None:
        """The float-preserving and numerics-changing graph passes."""

    def plan(self, model: ir.Model) -> Any:
        """The quantization plan, or None when the parameters need none (a recipe)."""
        return None

    def parameters(self, model: ir.Model, plan: Any) -> Any:
        """What :meth:`insert` writes: ``{tensor: QuantParams}`` or the solved positions."""
        raise NotImplementedError

    def insert(self, model: ir.Model, plan: Any, parameters: Any) -> dict[str, QuantParams]:
        """Write the Q/DQ pairs and quantized constants; the parameters written."""
        from quark_onnx.passes.insert_qdq import InsertQDQ

        inserter = InsertQDQ(parameters)
        inserter(model)
        return inserter.params

    def accuracy(
        self, model: ir.Model, plan: Any, params: dict[str, QuantParams]
    ) -> dict[str, QuantParams]:
        """Stages that change the written codes; the parameters the model holds after them."""
        return params

    def measure(
        self, model: ir.Model, plan: Any, params: dict[str, QuantParams]
    ) -> tuple[ir.Model, dict[str, QuantParams]]:
        """Measurements of the quantized model before it is finalized (its batch sizes free);
        the model and parameters kept (a repair may replace both)."""
        return model, params

    def finalize(self, model: ir.Model) -> onnx.ModelProto:
        """The finalize passes; the model as written."""
        raise NotImplementedError

    def release(self) -> None:
        """Drop what earlier stages kept (float copies), before finalize writes the result."""

    def check(self, model: onnx.ModelProto) -> None:
        """The readiness check of the written model."""

    def save(self, model: onnx.ModelProto) -> None:
        """Write the model."""


def _line(stages: Stages, desc: str) -> contextlib.AbstractContextManager:
    return StageLine(desc, enabled=False if stages.progress is False else None)


def run(stages: Stages) -> Outcome:
    """Run ``stages`` in the pipeline's order (module docstring)."""
    with _line(stages, "loading the model"):
        model = stages.load()
    with _line(stages, "preparing the float graph"):
        stages.prepare(model)
    with _line(stages, "planning"):
        plan = stages.plan(model)
    parameters = stages.parameters(model, plan)
    with _line(stages, "writing the Q/DQ pairs"):
        params = stages.insert(model, plan, parameters)
    del parameters
    with _line(stages, "accuracy stages (bias correction, rounding)"):
        params = stages.accuracy(model, plan, params)
    with _line(stages, "measuring the quantized model"):
        model, params = stages.measure(model, plan, params)
    # nothing after the measurements reads the plan or the float copies: gone before finalize
    # writes the protobuf beside the working graph
    del plan
    stages.release()
    with _line(stages, "finalizing"):
        quantized = stages.finalize(model)
    # the graph objects of the working model are the largest thing held per node: dropped
    # before the check builds its own view of the quantized model (its node/value cycles need
    # a collection)
    del model
    gc.collect()
    # made beside the graph's objects, the parameters would keep heap pages the graph freed
    # through the check (measured: benchmarks/results/stage_memory_add_chain.txt)
    params = memory.compact(params)
    with _line(stages, "checking readiness"):
        stages.check(quantized)
    with _line(stages, "saving"):
        stages.save(quantized)
    return Outcome(quantized, params)
