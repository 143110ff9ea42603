"""The calibration feeds as calibration runs them: validated, limited, grouped into runs.

:func:`validated_feeds` checks each feed against the model's inputs and stops at the sample
limit; :func:`batches` groups consecutive feeds into one run when the model's batch axis allows
it (up to ``max_batch`` samples concatenated on axis 0) and counts the non-finite input values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from quark_onnx.calibration.readers import CalibrationDataReader, InputSpec, validate_feed

Feed = dict[str, np.ndarray]


def validated_feeds(
    reader: CalibrationDataReader, specs: Sequence[InputSpec], limit: int
) -> Iterator[tuple[Feed, int]]:
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


def batches(
    reader: CalibrationDataReader,
    specs: Sequence[InputSpec],
    limit: int,
    *,
    combine: bool,
    max_batch: int,
    nonfinite: dict[str, int],
) -> Iterator[tuple[Feed, int, int]]:
    """Validated feeds, grouped into runs: ``(feed, rows, index of the first feed)``.

    With ``combine``, consecutive feeds of the same trailing shapes are concatenated up to
    ``max_batch`` rows (a feed is never split); otherwise each feed is one run. ``nonfinite``
    receives the count of NaN/Inf values per float input.
    """
    pending: list[Feed] = []
    pending_rows = 0
    pending_first = 0

    def flush() -> tuple[Feed, int, int]:
        feed = (
            pending[0]
            if len(pending) == 1
            else {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}
        )
        return feed, pending_rows, pending_first

    for index, (feed, rows) in enumerate(validated_feeds(reader, specs, limit)):
        count_nonfinite(feed, nonfinite)
        if not combine:
            yield feed, rows, index
            continue
        if pending and (
            pending_rows + rows > max_batch
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


def count_nonfinite(feed: Feed, counts: dict[str, int]) -> None:
    """Add each float input's number of NaN/Inf values to ``counts``."""
    for name, value in feed.items():
        if np.issubdtype(value.dtype, np.floating) and value.size:
            bad = value.size - int(np.count_nonzero(np.isfinite(value)))
            if bad:
                counts[name] = counts.get(name, 0) + bad
