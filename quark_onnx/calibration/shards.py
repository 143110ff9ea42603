"""Sharded calibration: the calibration data cut into K parts, each calibrated by its own process
(or Ray task), the observers merged: :func:`calibrate_sharded`.

Why this is exact. Every observer is mergeable (:mod:`quark_onnx.calibration.observers`): min/max
merge by min/max; a histogram merges by adding its integer bucket counts and offset sums. So K
observers over K disjoint parts of the data merge into the observer over all of it, and the
positions chosen from it (NonOverflow from min/max; MinMSE from the integer bucket statistics)
are those of a single-process run: the quantized model is byte for byte the same. The only
float statistic, a histogram's sum of squares, enters MinMSE as a constant added to every
candidate's error (the spread of the values about their bucket midpoints); it merges up to
float64 rounding (about 1e-16 of the sum), which could only move the argmin between two
positions whose errors agree to that precision (the tests check the bytes on real models).
The shards return the observers of the tensors they read (graph inputs and node outputs),
which are merged, and of the initializers (observed once, from shard 0); the tensors derived
from those (a Relu output from its input, a Concat output from its inputs) are derived once,
after the merge, as in one process.

The shards are contiguous in the reader's order, so every observer sees the same runs as in one
process. A model whose batch axis is dynamic is run on up to
:data:`~quark_onnx.calibration.collector.DEFAULT_MAX_BATCH` consecutive feeds at once; the shards
are then cut at multiples of that many feeds, so the runs (and onnxruntime's arithmetic in them)
are those of one process when every feed is one sample.

What each shard receives: the serialized (prepared) model -- small when the model's weights stay
in external-data files, which each shard then reads from ``external_data_dir`` (a path every
worker must see) -- the tensor names, the options, and its part of the feeds. The driver reads the
calibration data once (its reader is not shared), so it holds the input samples, not the
activations, of the whole calibration set.

Not mergeable, hence refused: MinMax with ``CalibMovingAverage`` (the average depends on the
order of all batches).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx

from quark_onnx.calibration.collector import DEFAULT_MAX_BATCH, Collector, report_nonfinite
from quark_onnx.calibration.feeds import validated_feeds
from quark_onnx.calibration.observers import Observer
from quark_onnx.calibration.readers import ArrayDataReader, input_specs, reader_for
from quark_onnx.calibration.result import CalibrationResult, model_hash
from quark_onnx.calibration.tensors import derive_observers
from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod, coerce_calibrate_method
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import CalibrationError, ConfigError
from quark_onnx.model_files.external import fits_in_protobuf

logger = logging.getLogger(__name__)

#: Where the shards run: spawned processes on this machine, or Ray tasks (``quark_onnx[ray]``).
ShardBackend = Literal["processes", "ray"]
BACKENDS: tuple[str, ...] = ("processes", "ray")

Feed = dict[str, np.ndarray]


@dataclasses.dataclass
class ShardStatistics:
    """What one shard returns (picklable): the observers of the tensors it read and of the
    constants, how the other tensors derive from them, samples and non-finite input counts."""

    observers: dict[str, Observer]
    constants: list[str]
    derived: list[tuple[str, str, list[str]]]
    samples: int
    input_nonfinite: dict[str, int]


def split_shards(feeds: Sequence[Feed], shards: int, align: int = 1) -> list[list[Feed]]:
    """``feeds`` cut into at most ``shards`` contiguous, non-empty parts of near-equal size.

    Cuts fall only at multiples of ``align`` feeds (so fewer parts than ``shards`` when there are
    fewer than ``shards * align`` feeds); earlier parts take the remainder.
    """
    if shards < 1:
        raise ConfigError(f"calibration shards: expected a positive number, got {shards}")
    units = -(-len(feeds) // align)
    count = min(shards, units)
    if count == 0:
        return []
    base, extra = divmod(units, count)
    parts = []
    start = 0
    for i in range(count):
        stop = min(len(feeds), start + (base + (i < extra)) * align)
        parts.append(list(feeds[start:stop]))
        start = stop
    return parts


def calibrate_shard(
    model_bytes: bytes,
    tensor_names: Sequence[str],
    feeds: Sequence[Feed],
    method: CalibrationMethod | PowerOfTwoMethod,
    options: ExtraOptions,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    external_data_dir: str | None = None,
) -> ShardStatistics:
    """Calibrate one shard (runs in a worker): the statistics before the empty-tensor check."""
    model = onnx.load_from_string(model_bytes)
    collector = Collector(
        model,
        tensor_names,
        method=method,
        options=options,
        providers=providers,
        external_data_dir=external_data_dir,
    )
    try:
        result = collector.run(ArrayDataReader(list(feeds)), progress=False, final=False)
    finally:
        collector.close()
    measured = [*collector.fed, *collector.sources, *collector.constants]
    return ShardStatistics(
        observers={name: collector.observers[name] for name in measured},
        constants=list(collector.constants),
        derived=collector.derived,
        samples=result.num_samples,
        input_nonfinite=collector.input_nonfinite,
    )


def merge_shards(parts: Sequence[ShardStatistics], names: Sequence[str]) -> ShardStatistics:
    """The statistics of all shards together: the observers read merged in shard order, the
    constants' taken once, then the derived tensors derived; only ``names`` kept."""
    first = parts[0]
    observers: dict[str, Observer] = {}
    for name, obs in first.observers.items():
        if name not in first.constants:
            for part in parts[1:]:
                obs = obs.merge(part.observers[name])
        observers[name] = obs
    derive_observers(observers, first.derived)
    nonfinite: dict[str, int] = {}
    for part in parts:
        for key, bad in part.input_nonfinite.items():
            nonfinite[key] = nonfinite.get(key, 0) + bad
    return ShardStatistics(
        {name: observers[name] for name in names},
        first.constants,
        first.derived,
        sum(p.samples for p in parts),
        nonfinite,
    )


def calibrate_sharded(
    model: onnx.ModelProto,
    tensor_names: Sequence[str],
    reader: Any,
    *,
    method: CalibrationMethod | PowerOfTwoMethod,
    options: ExtraOptions,
    shards: int,
    backend: ShardBackend = "processes",
    providers: Sequence[str] = ("CPUExecutionProvider",),
    external_data_dir: str | Path | None = None,
) -> CalibrationResult:
    """:func:`~quark_onnx.calibration.calibrate` with the data cut into ``shards`` parts run in
    parallel (``backend``: spawned processes, or Ray tasks of the cluster ``ray`` is connected to
    -- or of a local one it starts); the result is that of one process (see the module doc).

    Raises:
        ConfigError: ``shards < 1``, an unknown backend, MinMax with ``CalibMovingAverage``, a
            model above the protobuf limit, or ``backend="ray"`` without Ray installed.
        CalibrationError: as :func:`~quark_onnx.calibration.calibrate`.
    """
    method = coerce_calibrate_method(method)
    if shards < 1:
        raise ConfigError(f"calibration shards: expected a positive number, got {shards}")
    if backend not in BACKENDS:
        raise ConfigError(f"calibration shard backend {backend!r}: expected one of {BACKENDS}")
    if method is CalibrationMethod.MinMax and options.CalibMovingAverage:
        raise ConfigError(
            "CalibMovingAverage depends on the order of all batches, so sharded calibration "
            "cannot merge it: calibrate in one process (1 shard) or set CalibMovingAverage=false"
        )
    names = list(dict.fromkeys(tensor_names))
    data = reader_for(model, reader, options)
    specs = input_specs(model)
    feeds = [feed for feed, _ in validated_feeds(data, specs, max(0, int(options.CalibDataSize)))]
    if not feeds:
        raise CalibrationError(
            "the calibration data reader yielded no samples (get_next() returned None at "
            "once); give at least one feed, or set UseRandomData=True"
        )
    align = DEFAULT_MAX_BATCH if specs and all(s.batch_dynamic for s in specs) else 1
    parts = split_shards(feeds, shards, align)
    del feeds
    if not fits_in_protobuf(model):
        raise ConfigError(
            "sharded calibration ships the model to every shard and this one is above the 2 GB "
            "protobuf limit: keep its weights in external data (quark_onnx does so for models "
            "loaded from a path), or calibrate in one process"
        )
    model_bytes = model.SerializeToString()
    # each shard reads exactly its feeds (the limit is applied above), never random data
    shard_options = dataclasses.replace(options, CalibDataSize=0, UseRandomData=False)
    ext = str(external_data_dir) if external_data_dir is not None else None
    rest = [(names, part, method, shard_options, tuple(providers), ext) for part in parts]
    start = time.perf_counter()
    if len(parts) == 1:
        results = [calibrate_shard(model_bytes, *rest[0])]
    elif backend == "ray":
        from quark_onnx.runtime import ray_cluster

        results = ray_cluster.map_shared(calibrate_shard, model_bytes, rest)
    else:
        results = _map_processes(model_bytes, rest)
    merged = merge_shards(results, names)
    report_nonfinite(names, merged.observers, merged.input_nonfinite, merged.samples)
    logger.info(
        "calibrated %d tensors on %d samples in %d shards (%s) in %.2f s",
        len(names),
        merged.samples,
        len(parts),
        backend,
        time.perf_counter() - start,
    )
    return CalibrationResult(model_hash(model), method.name, merged.samples, merged.observers)


def _map_processes(model_bytes: bytes, rest: list[tuple]) -> list[ShardStatistics]:
    """``calibrate_shard`` of every shard, one spawned process each (onnxruntime and ``fork``
    do not mix); results in shard order, the first failure re-raised."""
    from quark_onnx.runtime.lifetime import die_with_parent

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(
        len(rest), mp_context=context, initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = [pool.submit(calibrate_shard, model_bytes, *args) for args in rest]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
