"""Run the model on calibration data and feed the observers: :func:`calibrate`.

What is read and from where (session outputs, feeds, initializers, or derived from other
tensors) is planned by :mod:`quark_onnx.calibration.tensors`; the session over a copy of the model
(one session, or the graph piece by piece above :data:`quark_onnx.runtime.sessions.SEGMENT_NODES`
nodes) is :mod:`quark_onnx.calibration.session`; the feeds are validated and grouped into runs by
:mod:`quark_onnx.calibration.feeds`. This module streams the runs into the observers.

The tensors read are folded into numpy observers: running min/max for MinMax/NonOverflow, the
bucket histogram for MinMSE/Percentile/Entropy/MSE. (In-graph ``ReduceMin``/``ReduceMax`` outputs
are not used: slower on CPU -- the reductions run after a layout reorder of every tensor -- and
``ReduceMax`` may skip NaN.)

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
``benchmarks/results/measurements.md``.) A graph run piece by piece runs groups of
:data:`~quark_onnx.calibration.session.SEGMENT_RUNS` runs through each piece and folds each
piece's values in run order: every observer sees the same values in the same order as with one
session, so the statistics are the same bit for bit.

Memory: the heap's freed pages go back to the OS after the plan and after the session is built.
During the runs what is held is onnxruntime's arena (one run's tensors, its outputs included: no
memory pattern, see :func:`~quark_onnx.calibration.session.session_options`), the part of the next
run that overlaps the fold, and the observers (MinMSE: a staging array per tensor, and the
buckets). Binding the outputs to preallocated numpy buffers (onnxruntime IOBinding) is not used:
it held more per run.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quark_onnx.calibration.feeds import batches
from quark_onnx.calibration.observers import HistogramObserver, MinMaxObserver, Observer
from quark_onnx.calibration.readers import CalibrationDataReader, input_specs, reader_for
from quark_onnx.calibration.result import CalibrationResult, model_hash
from quark_onnx.calibration.session import SEGMENT_RUNS, CalibrationSession
from quark_onnx.calibration.tensors import can_combine, derive_observers, plan_reads
from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod, coerce_calibrate_method
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import CalibrationError
from quark_onnx.runtime.memory import release_freed_memory
from quark_onnx.runtime.progress import Progress

logger = logging.getLogger(__name__)

_HISTOGRAM_METHODS = {
    PowerOfTwoMethod.MinMSE,
    CalibrationMethod.Percentile,
    CalibrationMethod.Entropy,
    CalibrationMethod.MSE,
}
#: Samples concatenated into one run when the model has a dynamic batch axis.
DEFAULT_MAX_BATCH = 8


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


class Collector:
    """The plan, the session, the observers and the streaming loop of one calibration.

    ``segment_nodes``: above this many nodes the copy runs piece by piece (default
    :data:`quark_onnx.runtime.sessions.SEGMENT_NODES`).
    """

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
        segment_nodes: int | None = None,
    ) -> None:
        self.model = model
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
        self._helper: concurrent.futures.ThreadPoolExecutor | None = None
        # measured on the runs and folds so far: when to start the next run (see _observe)
        self._run_seconds = 0.0
        self._fold_seconds_per_value: float | None = None
        plan = plan_reads(model, self.names, self.specs, self.moving_average is not None)
        self.types, self._shapes = plan.types, plan.shapes
        self.sources, self.fed = plan.sources, plan.fed
        self.constants, self.derived = plan.constants, plan.derived
        self.combine = can_combine(plan, self.specs, self.moving_average is not None)
        logger.debug(
            "calibration plan: %d read from the session, %d from feeds, %d constants, %d derived; "
            "batching feeds: %s",
            len(self.sources),
            len(self.fed),
            len(self.constants),
            len(self.derived),
            self.combine,
        )
        release_freed_memory()  # the shape-inference copies
        self.runner = CalibrationSession(
            model,
            self.sources,
            self.types,
            providers=self.providers,
            external_data_dir=external_data_dir,
            segment_nodes=segment_nodes,
        )
        self.session = self.runner.session
        self.fetch = self.runner.fetch

    def _new_observer(self) -> Observer:
        return HistogramObserver() if self.histogram else MinMaxObserver(self.moving_average)

    def close(self) -> None:
        self.runner.close()

    def _run(self, feed: dict[str, np.ndarray], first: int) -> list[np.ndarray]:
        outputs = self.runner.run(feed, first)
        self._run_seconds = self.runner.run_seconds
        return outputs

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
        self.input_nonfinite: dict[str, int] = {}
        runs = batches(
            reader,
            self.specs,
            limit,
            combine=self.combine,
            max_batch=self.max_batch,
            nonfinite=self.input_nonfinite,
        )
        with display:
            if self.runner.segmented:
                samples = self._stream_pieces(runs, display)
            else:
                samples = self._stream(runs, display)
        if samples == 0:
            raise CalibrationError(
                "the calibration data reader yielded no samples (get_next() returned None at "
                "once); give at least one feed, or set UseRandomData=True"
            )
        for obs in self.observers.values():
            if isinstance(obs, HistogramObserver):
                obs.flush()  # bin what is buffered, release the staging arrays
        derive_observers(self.observers, self.derived)
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

    def _stream(self, runs: Iterable[tuple[dict, int, int]], display: Progress) -> int:
        """One session: each run folded while the next one runs (module doc); the samples."""
        samples = 0
        with contextlib.ExitStack() as stack:
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(max_workers=1))
            if self.histogram and self.parallel:  # heavy updates: a second thread folds half
                self._helper = stack.enter_context(
                    concurrent.futures.ThreadPoolExecutor(max_workers=1)
                )
                stack.callback(setattr, self, "_helper", None)
            previous = None
            for feed, rows, first in runs:
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
        return samples

    def _stream_pieces(self, runs: Iterable[tuple[dict, int, int]], display: Progress) -> int:
        """The graph piece by piece: groups of :data:`SEGMENT_RUNS` runs, each piece's values
        folded in run order as the piece ends (module doc); the samples."""
        samples = 0
        group: list[tuple[dict, int, int]] = []
        for run in [*runs, None]:
            if run is not None:
                group.append(run)
                samples += run[1]
            if group and (run is None or len(group) == SEGMENT_RUNS):
                feeds = [feed for feed, _, _ in group]
                for feed in feeds:
                    for name in self.fed:
                        self.observers[name].update(feed[name])
                for values in self.runner.run_pieces(feeds, group[0][2]):
                    for name in list(values):
                        for value in values.pop(name):
                            self.observers[name].update(value)
                display.update(sum(rows for _, rows, _ in group))
                group = []
        return samples


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
