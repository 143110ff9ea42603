"""Run the model on calibration data and feed the observers: :func:`calibrate`.

One onnxruntime session is built, in memory, over a copy of the model (the user's model and its
folder are never touched; only a model above the 2 GB protobuf limit is written, to a temporary
directory removed afterwards). What the copy exposes depends on the statistics the method needs:

The tensors to read become extra graph outputs and are folded into numpy observers: running
min/max for MinMax/NonOverflow, the bucket histogram for MinMSE/Percentile/Entropy/MSE. (In-graph
``ReduceMin``/``ReduceMax`` outputs are not used: slower on CPU -- the reductions run after a
layout reorder of every tensor -- and ``ReduceMax`` may skip NaN.)

Tensors whose statistics follow exactly from other calibrated tensors are not read at all:
``Relu(x)`` from ``x`` (positive part, the rest counted as zeros), ``Concat`` from its inputs
(merged observers), and ``Identity``/``Reshape``/``Flatten``/``Squeeze``/``Unsqueeze``/
``Transpose``/inference ``Dropout`` outputs from their input. Graph inputs are observed from the
feeds, initializers once from their values.

Batches are streamed: each feed is validated, run and folded into constant-size observers, then
dropped. When every input's axis 0 is the same named dynamic dimension and every tensor read
carries it on axis 0, up to ``max_batch`` samples from consecutive feeds are concatenated into one
run. The next run overlaps the observer updates of the previous one (onnxruntime releases the GIL),
but starts only when what is left to fold would take about one run (both timed on the previous
batches): started at once, it would hold two runs' outputs for the whole fold whenever folding is
the slower part (as MinMSE's is). The outputs
are onnxruntime's own buffers: each is dropped as soon as it is folded, so the next run reuses its
memory. Histogram updates can be split between two threads (``parallel=True``;
each observer is folded by one thread in batch order, so the statistics are exactly those of one
thread), but that is off by default: on 2 cores, with onnxruntime's two intra-op threads running
the next batch, a second folding thread only adds contention -- the scatter ``np.add.at`` holds
the GIL. The histogram's scatter is most of an observer's cost per value. (Measurements:
``benchmarks/results/measurements.md``.)

Memory: shape inference (for the types of the tensors read) runs on a copy that carries the
weights' names, types and dims but not their bytes (:func:`_inference_copy`); the calibration copy
is serialized and dropped before onnxruntime parses it, and the session does not keep the bytes;
the heap's freed pages go back to the OS after the plan and after the session is built. During the
runs what is held is onnxruntime's arena (one run's tensors, its outputs included: no memory
pattern, see :func:`session_options`), the part of the next run that overlaps the fold, and the
observers (MinMSE: a staging array per tensor, and the buckets). Binding the outputs to
preallocated numpy buffers (onnxruntime IOBinding) is not used: it held more per run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from quark_onnx.enums import CalibrationMethod, PowerOfTwoMethod, coerce_calibrate_method
from quark_onnx.errors import CalibrationError
from quark_onnx.memory import release_freed_memory
from quark_onnx.model_io import copy_fields, fits_in_protobuf, save_model
from quark_onnx.npu.ops import spec
from quark_onnx.options import ExtraOptions, closest_name
from quark_onnx.progress import Progress

from .observers import HistogramObserver, MinMaxObserver, Observer
from .readers import CalibrationDataReader, input_specs, reader_for, validate_feed
from .result import CalibrationResult, model_hash

logger = logging.getLogger(__name__)

_FLOAT_TYPES = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16,
}


def _same_values(op_type: str) -> bool:
    """The op's output values are input values (its row in the NPU op table says so)."""
    row = spec(op_type)
    return row is not None and row.same_values


_HISTOGRAM_METHODS = {
    PowerOfTwoMethod.MinMSE,
    CalibrationMethod.Percentile,
    CalibrationMethod.Entropy,
    CalibrationMethod.MSE,
}
#: Samples concatenated into one run when the model has a dynamic batch axis.
DEFAULT_MAX_BATCH = 8


#: Above this many nodes the calibration session uses onnxruntime's basic optimizations only:
#: its extended and layout optimizers cost more than linear time in the node count, which the
#: faster kernels of a graph that large never pay back over a calibration run.
EXTENDED_OPTIMIZATION_MAX_NODES = 4000


def session_options(nodes: int = 0) -> ort.SessionOptions:
    """Session options of the calibration session (and of any timing comparison against it).

    Full graph optimisation (basic only above :data:`EXTENDED_OPTIMIZATION_MAX_NODES` ``nodes``):
    onnxruntime never fuses away a graph output, so the tensors read are those of the float model
    (up to the float rounding of its optimised kernels).

    The intra-op threads do not spin between kernels: the observers run in Python beside the
    session (next batch in onnxruntime, previous batch in numpy), and spinning threads would take
    the cores numpy needs.

    No memory pattern: with one, onnxruntime plans every later run into a single block of its
    own, which its arena cannot carve from the chunks the first (unplanned) run left free, so the
    arena holds both. Without, each run allocates tensor by tensor from those chunks, in less
    memory and the same time (``benchmarks/results/measurements.md``).
    """
    from quark_onnx import runtime

    return runtime.session_options(
        optimize="all" if nodes <= EXTENDED_OPTIMIZATION_MAX_NODES else "basic",
        spinning=False,
        mem_pattern=False,
    )


def calibrate(
    model: onnx.ModelProto,
    tensor_names: Sequence[str],
    reader: Any,
    *,
    method: CalibrationMethod | PowerOfTwoMethod,
    options: ExtraOptions,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    progress: bool | Callable[[int, int | None, float], None] | None = None,
    external_data_dir: str | Path | None = None,
) -> CalibrationResult:
    """Run ``model`` on the calibration data and return the statistics of ``tensor_names``.

    ``tensor_names`` may name graph inputs, intermediate values, graph outputs and initializers.
    ``reader`` is anything :func:`~quark_onnx.calibration.readers.reader_for` accepts (random data
    with ``options.UseRandomData``). At most ``options.CalibDataSize`` samples are used (0: all).
    ``progress``: ``None`` shows a live line when stderr is a terminal (log lines otherwise),
    ``True`` always reports, ``False`` never; a callable gets ``(done, total, rate)``.
    ``external_data_dir``: the folder ``model``'s external-data references are relative to (a
    model serialized with ``model_io.to_proto(..., keep_external=True)``); onnxruntime then maps
    those weights from their files instead of receiving a copy.

    Raises:
        CalibrationError: no samples, a feed that does not match the model's inputs, an unknown or
            non-float tensor name, onnxruntime failing on a feed, or a tensor with no finite value.
    """
    method = coerce_calibrate_method(method)
    data = reader_for(model, reader, options)
    collector = Collector(
        model,
        tensor_names,
        method=method,
        options=options,
        providers=providers,
        external_data_dir=external_data_dir,
    )
    try:
        return collector.run(data, progress=progress)
    finally:
        collector.close()


def _keep_only_what_feeds(graph: onnx.GraphProto, wanted: set[str]) -> None:
    """Drop the nodes and outputs of the calibration copy that no calibrated tensor depends on.

    onnxruntime then neither runs them nor needs to know them: a custom op after the quantized part
    (or one it cannot run at all) no longer stops calibration, and nothing is computed for
    nothing. Graphs with subgraph attributes (If/Loop/Scan) are left whole: their bodies read
    outer values that the node's inputs do not list.
    """
    if any(
        a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
        for node in graph.node
        for a in node.attribute
    ):
        return
    needed = set(wanted)
    keep = []
    for node in reversed(graph.node):  # ONNX nodes are in topological order
        if any(out in needed for out in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    if not keep:  # only graph inputs are wanted: onnxruntime refuses a graph without nodes
        return
    keep.reverse()
    outputs = [o for o in graph.output if o.name in wanted]
    del graph.node[:]
    graph.node.extend(keep)
    del graph.output[:]
    graph.output.extend(outputs)


@contextlib.contextmanager
def _load_errors() -> Iterator[None]:
    """onnxruntime's refusal of the calibration copy as a :class:`CalibrationError`."""
    try:
        yield
    except CalibrationError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CalibrationError(
            f"onnxruntime cannot load the calibration copy of the model: {first}"
        ) from exc


#: Initializers up to this many elements keep their values in the shape-inference copy: the
#: inputs whose values shape inference reads (Reshape/Expand/ConstantOfShape shapes, Slice/Pad/
#: Tile/Resize/Range/TopK/Split/reduction parameters) have at most a few per axis.
_INFERENCE_KEEPS_VALUES = 4096


def _inference_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for shape inference: every field copied but the values of large initializers.

    A large initializer keeps its name, type and dims (all that shape inference takes from a tensor
    it does not read), so the inferred types and shapes are those of the whole model.
    """
    light = onnx.ModelProto()
    copy_fields(model, light, {"graph"})
    copy_fields(model.graph, light.graph, {"initializer"})
    for t in model.graph.initializer:
        if math.prod(t.dims) <= _INFERENCE_KEEPS_VALUES:
            light.graph.initializer.add().CopyFrom(t)
        else:
            light.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    return light


def validated_feeds(
    reader: CalibrationDataReader, specs: Sequence[Any], limit: int
) -> Iterator[tuple[dict[str, np.ndarray], int]]:
    """The reader's feeds, validated against the model inputs, up to ``limit`` samples (0: all):
    ``(feed, rows)``. A feed that crosses the limit is cut when the batch axis is dynamic."""
    samples = 0
    index = 0
    while not limit or samples < limit:
        raw = reader.get_next()
        if raw is None:
            return
        feed, rows = validate_feed(raw, specs, index, samples)
        if limit and samples + rows > limit and specs and specs[0].batch_dynamic:
            keep = limit - samples
            feed = {k: v[:keep] for k, v in feed.items()}
            rows = keep
        samples += rows
        index += 1
        yield feed, rows


class Collector:
    """The session, the observers and the streaming loop of one calibration."""

    def __init__(
        self,
        model: onnx.ModelProto,
        tensor_names: Sequence[str],
        *,
        method: CalibrationMethod | PowerOfTwoMethod,
        options: ExtraOptions,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        max_batch: int = DEFAULT_MAX_BATCH,
        pipeline: bool = True,
        parallel: bool = False,
        external_data_dir: str | Path | None = None,
    ) -> None:
        self.model = model
        self.external_data_dir = external_data_dir
        self.method = coerce_calibrate_method(method)
        if self.method is CalibrationMethod.Distribution:
            raise CalibrationError(
                "calibration method Distribution is not supported; use MinMax, Percentile, "
                "Entropy, MSE, NonOverflow or MinMSE"
            )
        self.options = options
        self.providers = list(providers)
        self.max_batch = max(1, int(max_batch))
        self.pipeline = pipeline
        self.parallel = parallel
        self.histogram = self.method in _HISTOGRAM_METHODS
        self.moving_average = (
            options.CalibMovingAverageConstant
            if self.method is CalibrationMethod.MinMax and options.CalibMovingAverage
            else None
        )
        self.names = list(dict.fromkeys(tensor_names))
        self.specs = input_specs(model)
        self._tmpdir: tempfile.TemporaryDirectory | None = None
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        # measured on the runs and folds so far: when to start the next run (see _observe)
        self._run_seconds = 0.0
        self._fold_seconds_per_value: float | None = None
        self._plan()
        release_freed_memory()  # the shape-inference copies
        self._build_session()

    # --- planning ------------------------------------------------------------------------------

    def _new_observer(self) -> Observer:
        return HistogramObserver() if self.histogram else MinMaxObserver(self.moving_average)

    def _plan(self) -> None:
        graph = self.model.graph
        producers = {out: node for node in graph.node for out in node.output if out}
        inits = {t.name: t for t in graph.initializer}
        input_names = {s.name for s in self.specs}
        known = set(producers) | set(inits) | input_names
        missing = [n for n in self.names if n not in known]
        if missing:
            close = closest_name(missing[0], known)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise CalibrationError(
                f"tensor {missing[0]!r}{hint} is not a graph input, initializer or node output of "
                f"the model's main graph"
                + (f"; {len(missing)} such names" if len(missing) > 1 else "")
            )
        self.types = self._value_types()
        for name in self.names:
            elem = self.types.get(name)
            if elem is not None and elem not in _FLOAT_TYPES:
                raise CalibrationError(
                    f"tensor {name!r} has type {onnx.TensorProto.DataType.Name(elem)}; only float "
                    "tensors can be calibrated"
                )
        wanted = set(self.names)
        self.derived: list[tuple[str, str, list[str]]] = []  # (name, rule, sources)
        derived_names: set[str] = set()
        self.constants: dict[str, np.ndarray] = {}
        self.fed: list[str] = []
        self.sources: list[str] = []
        for node in graph.node:  # topological order
            for out in node.output:
                if out not in wanted:
                    continue
                rule = self._derivation(node, out, wanted)
                if rule is not None:
                    self.derived.append(
                        (out, rule, list(node.input[:1] if rule != "merge" else node.input))
                    )
                    derived_names.add(out)
        for name in self.names:
            if name in derived_names:
                continue
            if name in input_names:
                self.fed.append(name)
            elif name in inits:
                self.constants[name] = onnx.numpy_helper.to_array(inits[name])
            else:
                self.sources.append(name)
        self.combine = self._can_combine()
        logger.debug(
            "calibration plan: %d read from the session, %d from feeds, %d constants, %d derived; "
            "batching feeds: %s",
            len(self.sources),
            len(self.fed),
            len(self.constants),
            len(self.derived),
            self.combine,
        )

    def _derivation(self, node: onnx.NodeProto, out: str, wanted: set[str]) -> str | None:
        """How ``out`` follows from other calibrated tensors, or None."""
        if out != node.output[0] or not node.input:
            return None
        src = node.input[0]
        if self.moving_average is not None:
            # batch-wise averages do not commute with Relu or Concat; identical data still is
            return "same" if _same_values(node.op_type) and src in wanted else None
        if node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Relu" and src in wanted:
            return "relu"
        if _same_values(node.op_type) and src in wanted:
            return "same"
        if node.op_type == "Dropout" and len(node.input) < 3 and src in wanted:
            return "same"
        if (
            node.op_type == "Concat"
            and all(i in wanted for i in node.input if i)
            and all(node.input)
        ):
            return "merge"
        return None

    def _value_types(self) -> dict[str, int]:
        """Element type of every value (graph inputs, outputs, inferred intermediates).

        Shape inference runs on :func:`_inference_copy` (the weights' types and shapes, not their
        bytes): inferring on the model itself copies every weight four times (Python to C++ and
        back), ~45 MB transient on MobileNetV2, which the heap then keeps.
        """
        types: dict[str, int] = {}
        model = self.model
        try:
            if fits_in_protobuf(model):
                model = onnx.shape_inference.infer_shapes(_inference_copy(model))
        except Exception as exc:  # inference is a help, not a requirement
            logger.debug("shape inference failed (%s); types unknown", exc)
        self._shapes: dict[str, onnx.TypeProto] = {}
        graph = model.graph
        for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types[vi.name] = vi.type.tensor_type.elem_type
                self._shapes[vi.name] = vi.type
        for t in graph.initializer:
            types[t.name] = t.data_type
        return types

    def _can_combine(self) -> bool:
        """Feeds may be concatenated when axis 0 is one named dynamic batch dimension."""
        if self.moving_average is not None or not self.specs:
            return False
        symbols = {s.dims[0] if s.dims else None for s in self.specs}
        if len(symbols) != 1:
            return False
        symbol = symbols.pop()
        if not isinstance(symbol, str):
            return False
        for name in self.sources:
            t = self._shapes.get(name)
            if t is None or not t.tensor_type.HasField("shape"):
                return False
            dims = t.tensor_type.shape.dim
            if not dims or dims[0].dim_param != symbol:
                return False
        return True

    # --- session -------------------------------------------------------------------------------

    def _build_session(self) -> None:
        """The session over the calibration copy; its heap is handed back to the OS after.

        The copy is serialized and dropped before onnxruntime parses the bytes, and the bytes are
        dropped once the session holds the weights (``InferenceSession`` keeps them otherwise,
        only to rebuild itself on ``set_providers``, which calibration never calls): what stays
        is the model and the session's own weights.
        """
        copy_ = self._calibration_copy()
        if not fits_in_protobuf(copy_):
            self.session = self._session_from_file(copy_)
            return
        data = copy_.SerializeToString()
        del copy_
        self.session = self._session_from_bytes(data)
        del data
        release_freed_memory()

    def _calibration_copy(self) -> onnx.ModelProto:
        """A copy of the model whose outputs are the tensors read, pruned to what they need."""
        graph_copy = onnx.ModelProto()
        graph_copy.CopyFrom(self.model)
        existing_outputs = {o.name for o in graph_copy.graph.output}
        self.fetch: list[str] = []
        g = graph_copy.graph
        for src in self.sources:
            if src not in existing_outputs:
                elem = self.types.get(src, onnx.TensorProto.FLOAT)
                g.output.append(onnx.helper.make_tensor_value_info(src, elem, None))
            self.fetch.append(src)
        _keep_only_what_feeds(g, set(self.fetch))
        return graph_copy

    def _session_from_bytes(self, data: bytes) -> ort.InferenceSession:
        from quark_onnx import runtime

        # weights stay in the model's data files (onnxruntime maps them read-only)
        with _load_errors():
            return runtime.create_session(
                data,
                session_options(len(self.model.graph.node)),
                external_data_dir=self.external_data_dir,
                providers=self.providers,
                purpose="calibration",
            )

    def _session_from_file(self, proto: onnx.ModelProto) -> ort.InferenceSession:
        # Above 2 GB the model cannot be passed as bytes: stream it to a private temporary
        # folder with its weights as external data (never beside the user's model).
        with _load_errors():
            if self._tmpdir is None:
                self._tmpdir = tempfile.TemporaryDirectory(prefix="quark_onnx_calib_")
            path = Path(self._tmpdir.name) / f"calib_{id(proto)}.onnx"
            save_model(proto, path, external_data=True)
            from quark_onnx import runtime

            return runtime.create_session(
                path,
                session_options(len(proto.graph.node)),
                providers=self.providers,
                purpose="calibration",
            )

    def close(self) -> None:
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    # --- streaming -----------------------------------------------------------------------------

    def _batches(
        self, reader: CalibrationDataReader, limit: int
    ) -> Iterator[tuple[dict, int, int]]:
        """Validated feeds, grouped into runs: (feed, rows, index of the first feed)."""
        pending: list[dict[str, np.ndarray]] = []
        pending_rows = 0
        pending_first = 0
        self.input_nonfinite: dict[str, int] = {}

        def flush() -> tuple[dict, int, int]:
            feed = (
                pending[0]
                if len(pending) == 1
                else {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
            )
            return feed, pending_rows, pending_first

        for index, (feed, rows) in enumerate(validated_feeds(reader, self.specs, limit)):
            self._count_input_nonfinite(feed)
            if not self.combine:
                yield feed, rows, index
            else:
                if pending and (
                    pending_rows + rows > self.max_batch
                    or any(feed[k].shape[1:] != pending[0][k].shape[1:] for k in feed)
                ):
                    yield flush()
                    pending, pending_rows = [], 0
                if not pending:
                    pending_first = index
                pending.append(feed)
                pending_rows += rows
        if pending:
            yield flush()

    def _count_input_nonfinite(self, feed: dict[str, np.ndarray]) -> None:
        for name, value in feed.items():
            if np.issubdtype(value.dtype, np.floating) and value.size:
                bad = value.size - int(np.count_nonzero(np.isfinite(value)))
                if bad:
                    self.input_nonfinite[name] = self.input_nonfinite.get(name, 0) + bad

    def _run(self, feed: dict[str, np.ndarray], first: int) -> list[np.ndarray]:
        try:
            tic = time.perf_counter()
            outputs = self.session.run(self.fetch, feed) if self.fetch else []
            self._run_seconds = time.perf_counter() - tic
            return outputs
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise CalibrationError(
                f"onnxruntime failed on calibration feed #{first}: {first_line}"
            ) from exc

    def _observe(
        self,
        feed: dict[str, np.ndarray],
        first: int,
        outputs: list[np.ndarray],
        start_next: Callable[[], None] | None = None,
    ) -> None:
        """Fold one run into the observers, releasing each output as soon as it is folded (the
        arrays are onnxruntime's own buffers: the next run can reuse them while this one is
        still being observed).

        ``start_next`` (the caller's start of the next run) is called once, as late as still hides
        the next run behind this fold: when the values left to fold would take about one run's
        time, both measured on the previous batches (the first fold is not overlapped: it gives
        the first measure). Starting the next run at once would hold two runs' outputs for the
        whole fold whenever folding is slower than running (MinMSE: 26 MB each on MobileNetV2).
        """
        for name in self.fed:
            self.observers[name].update(feed[name])
        if self._helper is not None and len(outputs) >= 2:
            if start_next is not None:
                start_next()
            self._fold_in_two(self._helper, outputs)
            return
        left = total = sum(o.size for o in outputs)
        rate = self._fold_seconds_per_value
        tic = time.perf_counter()
        for i in range(len(outputs)):
            if start_next is not None and rate is not None and left * rate <= self._run_seconds:
                start_next()
                start_next = None
            left -= outputs[i].size
            self._fold(outputs, (i,))
        if total:
            self._fold_seconds_per_value = (time.perf_counter() - tic) / total
        if start_next is not None:
            start_next()

    def _fold_in_two(
        self, helper: concurrent.futures.ThreadPoolExecutor, outputs: list[Any]
    ) -> None:
        """Fold on two threads, each output by one of them (so every observer still sees its
        batches in order and computes exactly what one thread would)."""
        sizes = [o.size for o in outputs]
        mine: list[int] = []
        theirs: list[int] = []
        load = [0, 0]
        for i in sorted(range(len(outputs)), key=sizes.__getitem__, reverse=True):
            side = 0 if load[0] <= load[1] else 1
            (mine, theirs)[side].append(i)
            load[side] += sizes[i]
        other = helper.submit(self._fold, outputs, theirs)
        try:
            self._fold(outputs, mine)
        finally:
            other.result()

    def _fold(self, outputs: list[Any], indices: Iterable[int]) -> None:
        for i in indices:
            value, outputs[i] = outputs[i], None
            self.observers[self.sources[i]].update(value)
            del value

    def run(
        self,
        reader: CalibrationDataReader,
        progress: bool | Callable[[int, int | None, float], None] | None = None,
        *,
        final: bool = True,
    ) -> CalibrationResult:
        """Stream the reader through the session and return the result.

        ``final=False`` (one shard of :func:`quark_onnx.calibration.shards.calibrate_sharded`):
        the non-finite warnings and the empty-tensor check are left to whoever merges the shards,
        since they are about all the data, not one part of it.
        """
        limit = max(0, int(self.options.CalibDataSize))
        total = getattr(reader, "num_samples", None)
        if not isinstance(total, int):
            total = None
        if limit:
            total = min(total, limit) if total else limit
        self.observers: dict[str, Observer] = {n: self._new_observer() for n in self.fed}
        self.observers.update({n: self._new_observer() for n in self.sources})
        for name, value in self.constants.items():
            obs = self._new_observer()
            obs.update(value)
            self.observers[name] = obs
        display = Progress(
            total,
            desc="calibrating",
            unit="samples",
            enabled=False if progress is False else None,
            callback=progress if callable(progress) else None,
            logger=logger,
        )
        start = time.perf_counter()
        samples = 0
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(max_workers=1))
            if self.histogram and self.parallel:  # heavy updates: a second thread folds half
                self._helper = stack.enter_context(
                    concurrent.futures.ThreadPoolExecutor(max_workers=1)
                )
                stack.callback(setattr, self, "_helper", None)
            stack.enter_context(display)
            previous = None
            for feed, rows, first in self._batches(reader, limit):
                samples += rows
                if not self.pipeline:
                    self._observe(feed, first, self._run(feed, first))
                    display.update(rows)
                    continue
                if previous is None:
                    previous = (feed, rows, first, pool.submit(self._run, feed, first))
                    continue
                pfeed, prows, pfirst, pfuture = previous
                started: list[concurrent.futures.Future] = []

                def start_next(
                    feed: dict = feed, first: int = first, started: list = started
                ) -> None:
                    started.append(pool.submit(self._run, feed, first))

                self._observe(pfeed, pfirst, pfuture.result(), start_next)
                display.update(prows)
                previous = (feed, rows, first, started[0])
            if previous is not None:
                pfeed, prows, pfirst, pfuture = previous
                self._observe(pfeed, pfirst, pfuture.result())
                display.update(prows)
        if samples == 0:
            raise CalibrationError(
                "the calibration data reader yielded no samples (get_next() returned None at "
                "once); give at least one feed, or set UseRandomData=True"
            )
        for obs in self.observers.values():
            if isinstance(obs, HistogramObserver):
                obs.flush()  # bin what is buffered, release the staging arrays
        self._derive()
        if final:
            report_nonfinite(self.names, self.observers, self.input_nonfinite, samples)
        result = CalibrationResult(
            model_hash(self.model),
            self.method.name,
            samples,
            {name: self.observers[name] for name in self.names},
        )
        logger.info(
            "calibrated %d tensors on %d samples with %s in %.2f s",
            len(self.names),
            samples,
            self.method.name,
            time.perf_counter() - start,
        )
        return result

    def _derive(self) -> None:
        derive_observers(self.observers, self.derived)


def derive_observers(
    observers: dict[str, Observer], derived: Sequence[tuple[str, str, list[str]]]
) -> None:
    """Add the observers of the derived tensors (``(name, rule, sources)``, in graph order)."""
    for name, rule, srcs in derived:
        if rule == "same":
            observers[name] = copy.deepcopy(observers[srcs[0]])
        elif rule == "relu":
            observers[name] = observers[srcs[0]].relu()
        else:
            merged = observers[srcs[0]]
            for s in srcs[1:]:
                merged = merged.merge(observers[s])
            observers[name] = merged


def report_nonfinite(
    names: Sequence[str],
    observers: dict[str, Observer],
    input_nonfinite: dict[str, int],
    samples: int,
) -> None:
    """Warn about non-finite values; raise when a tensor saw no finite value at all."""
    for name, bad in input_nonfinite.items():
        logger.warning(
            "calibration input %r: %d non-finite values (NaN/Inf) in the feeds; they are "
            "ignored by every observer, check the data",
            name,
            bad,
        )
    empty = []
    for name in names:
        obs = observers[name]
        if obs.nonfinite:
            logger.warning(
                "tensor %r: %d non-finite values (NaN/Inf) ignored over %d samples; its range "
                "comes from the finite values only",
                name,
                obs.nonfinite,
                samples,
            )
        if obs.count == 0:
            empty.append(name)
    if empty:
        raise CalibrationError(
            f"tensor {empty[0]!r} had no finite value in {samples} calibration samples"
            + (f" (and {len(empty) - 1} more tensors)" if len(empty) > 1 else "")
            + "; check the data and the model"
        )
