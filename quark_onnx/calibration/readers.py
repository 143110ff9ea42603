"""Calibration data readers and the validation of what they yield.

A reader follows onnxruntime's ``CalibrationDataReader`` protocol: ``get_next()`` returns a feed
(``{input_name: ndarray}``) or ``None`` when exhausted; ``rewind()`` (optional) starts again. Any
object with ``get_next`` works, so readers written for onnxruntime or AMD Quark are accepted as is.

Samples: a feed holds ``rows`` samples, the length of axis 0 of its first input when that axis is
a dynamic dimension of the model, otherwise 1 (a model with a fixed batch takes one feed per run).

Every feed is checked against the model's inputs (:func:`validate_feed`): all inputs present, no
unknown name, exact dtype, rank, fixed dimensions, and the same size for a dimension name shared by
several inputs. A mismatch raises :class:`~quark_onnx.errors.CalibrationError` naming the input, the
feed and sample index, and what was expected.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import onnx

# the .npz/.npy reading, re-exported: readers and the CLI have always imported it from here
from quark_onnx.calibration.npz_files import load_array, max_array_bytes, npz_keys
from quark_onnx.config.options import ExtraOptions, did_you_mean
from quark_onnx.errors import CalibrationError
from quark_onnx.model_files.files import check_regular_file

logger = logging.getLogger(__name__)


@runtime_checkable
class CalibrationDataReader(Protocol):
    """onnxruntime's reader protocol: one feed per call, ``None`` at the end."""

    def get_next(self) -> dict[str, np.ndarray] | None: ...


# ------------------------------------------------------------------------------------------------
# Model inputs
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputSpec:
    """What a graph input accepts: name, numpy dtype, dims (int fixed, str named, None unknown)."""

    name: str
    elem_type: int
    dtype: np.dtype
    dims: tuple[int | str | None, ...] | None

    @property
    def batch_dynamic(self) -> bool:
        return bool(self.dims) and not isinstance(self.dims[0], int)

    def describe(self) -> str:
        if self.dims is None:
            return f"{self.dtype} of any shape"
        dims = ", ".join("?" if d is None else str(d) for d in self.dims)
        return f"{self.dtype}[{dims}]"


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The graph inputs a feed must provide (initializers listed as inputs are excluded)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise CalibrationError(
                f"model input {vi.name!r} is not a tensor; only tensor inputs can be calibrated"
            )
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type))
        dims: tuple[int | str | None, ...] | None = None
        if tt.HasField("shape"):
            dims = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                for d in tt.shape.dim
            )
        specs.append(InputSpec(vi.name, tt.elem_type, dtype, dims))
    return specs


def validate_feed(
    feed: Any, specs: Sequence[InputSpec], feed_index: int, first_sample: int
) -> tuple[dict[str, np.ndarray], int]:
    """Check one feed against the model inputs; return it (arrays) and its number of samples."""
    where = f"calibration feed #{feed_index} (sample {first_sample})"
    if not isinstance(feed, Mapping):
        raise CalibrationError(
            f"{where}: a reader must return a dict {{input name: numpy array}} or None, got "
            f"{type(feed).__name__}"
        )
    names = [s.name for s in specs]
    for key in feed:
        if key not in names:
            hint = did_you_mean(str(key), names)
            raise CalibrationError(
                f"{where}: {key!r} is not an input of the model{hint} (inputs: {', '.join(names)})"
            )
    out: dict[str, np.ndarray] = {}
    named: dict[str, tuple[int, str]] = {}
    for spec in specs:
        if spec.name not in feed:
            raise CalibrationError(
                f"{where}: input {spec.name!r} is missing (expected {spec.describe()})"
            )
        value = feed[spec.name]
        if not isinstance(value, np.ndarray):
            value = np.asarray(value)
        if value.dtype != spec.dtype:
            raise CalibrationError(
                f"{where}: input {spec.name!r} has dtype {value.dtype}, expected {spec.dtype} "
                f"({spec.describe()}); convert it with .astype(np.{spec.dtype})"
            )
        if spec.dims is not None:
            if value.ndim != len(spec.dims):
                raise CalibrationError(
                    f"{where}: input {spec.name!r} has shape {list(value.shape)} (rank "
                    f"{value.ndim}), expected rank {len(spec.dims)}: {spec.describe()}"
                )
            for axis, (want, got) in enumerate(zip(spec.dims, value.shape, strict=True)):
                if isinstance(want, int) and want > 0 and want != got:
                    raise CalibrationError(
                        f"{where}: input {spec.name!r} has shape {list(value.shape)}, expected "
                        f"{spec.describe()} (dimension {axis} must be {want})"
                    )
                if isinstance(want, str):
                    seen = named.setdefault(want, (got, spec.name))
                    if seen[0] != got:
                        raise CalibrationError(
                            f"{where}: dimension {want!r} is {seen[0]} in input {seen[1]!r} but "
                            f"{got} in input {spec.name!r}"
                        )
        out[spec.name] = value
    rows = 1
    first = specs[0] if specs else None
    if first is not None and first.batch_dynamic and out[first.name].ndim > 0:
        rows = int(out[first.name].shape[0])
        if rows == 0:
            raise CalibrationError(f"{where}: input {first.name!r} holds 0 samples (axis 0 is 0)")
    return out, rows


# ------------------------------------------------------------------------------------------------
# Readers
# ------------------------------------------------------------------------------------------------


class ArrayDataReader:
    """Feeds from numpy arrays already in memory.

    ``feeds`` is either a mapping ``{input name: array}`` whose arrays are stacked over samples on
    axis 0 (each feed is a slice of ``batch_size`` rows), or a sequence of feed mappings (each is
    one feed; ``batch_size > 1`` concatenates that many consecutive feeds on axis 0).
    """

    def __init__(
        self,
        feeds: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
        batch_size: int = 1,
    ) -> None:
        if batch_size < 1:
            raise CalibrationError(f"ArrayDataReader: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self._index = 0
        if isinstance(feeds, Mapping):
            self._stacked: dict[str, np.ndarray] | None = {
                k: np.asarray(v) for k, v in feeds.items()
            }
            lengths = {k: (v.shape[0] if v.ndim else 1) for k, v in self._stacked.items()}
            if len(set(lengths.values())) > 1:
                raise CalibrationError(
                    f"ArrayDataReader: arrays have different lengths on axis 0: {lengths}"
                )
            self._length = next(iter(lengths.values()), 0)
            self._list: list[Mapping[str, np.ndarray]] = []
        else:
            self._stacked = None
            self._list = list(feeds)
            self._length = len(self._list)

    def __len__(self) -> int:
        """Number of feeds this reader yields."""
        return -(-self._length // self.batch_size)

    @property
    def num_samples(self) -> int | None:
        """Samples in the stacked arrays (None for a list of feeds, whose rows are not known)."""
        return self._length if self._stacked is not None else None

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._index >= self._length:
            return None
        start, stop = self._index, min(self._index + self.batch_size, self._length)
        self._index = stop
        if self._stacked is not None:
            return {k: v[start:stop] for k, v in self._stacked.items()}
        group = self._list[start:stop]
        if len(group) == 1:
            return dict(group[0])
        return {k: np.concatenate([np.asarray(g[k]) for g in group]) for k in group[0]}

    def rewind(self) -> None:
        self._index = 0


class NpzDataReader(ArrayDataReader):
    """Feeds from one array of a ``.npz`` (or ``.npy``) file, stacked over samples on axis 0.

    ``key`` names the array in the archive; by default the only array, else the one named like
    ``input_name``, else ``"x"``. ``input_name`` defaults to the model's single input (bound by
    :func:`reader_for` / ``calibrate``). ``limit`` keeps the first samples only.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        input_name: str | None = None,
        key: str | None = None,
        batch_size: int = 1,
        limit: int | None = None,
    ) -> None:
        p = Path(path)
        check_regular_file(p, what="calibration data file", error=CalibrationError)
        keys = npz_keys(p)
        chosen = key
        if keys is None:
            chosen = None  # a .npy file holds one array
        elif chosen is None:
            if len(keys) == 1:
                chosen = keys[0]
            elif input_name in keys:
                chosen = input_name
            elif "x" in keys:
                chosen = "x"
            else:
                raise CalibrationError(f"{p}: holds arrays {keys}; say which one with key=...")
        if keys is not None and chosen not in keys:
            hint = did_you_mean(chosen, keys)
            raise CalibrationError(f"{p}: no array {chosen!r}{hint} (arrays: {keys})")
        array = load_array(p, chosen, limit)
        self.path = p
        self.input_name = input_name
        self._array = array
        super().__init__({input_name or "": array}, batch_size)

    def bind(self, model: onnx.ModelProto) -> None:
        """Take the input name from ``model`` when it was not given (single-input models)."""
        if self.input_name is not None:
            return
        names = [s.name for s in input_specs(model)]
        if len(names) != 1:
            raise CalibrationError(
                f"{self.path}: the model has inputs {names}; pass input_name=... to NpzDataReader"
            )
        self.input_name = names[0]
        self._stacked = {names[0]: self._array}

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.input_name is None:
            raise CalibrationError(
                f"{self.path}: NpzDataReader has no input name; pass input_name=... or use it "
                "through quark_onnx (which binds it to the model's input)"
            )
        return super().get_next()


class RandomDataReader:
    """Reproducible random feeds shaped and typed like the model's inputs (``UseRandomData``).

    Each of ``num_samples`` feeds draws every input from ``numpy.random.default_rng(seed)`` in
    order, so the same seed gives the same data and :meth:`rewind` replays it. Shapes: the model's
    fixed dimensions; a dynamic dimension takes its value from ``shapes[name]`` (a full shape list,
    option ``RandomDataReaderInputShape``) or else 1. Values: floats uniform in ``ranges[name]``
    (``[low, high)``, default ``[0, 1)``); integers uniform in ``[low, high)`` (default ``[0, 2)``);
    booleans fair coin flips.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        num_samples: int = 100,
        seed: int = 0,
        shapes: Mapping[str, Sequence[int]] | None = None,
        ranges: Mapping[str, Sequence[float]] | None = None,
    ) -> None:
        self.specs = input_specs(model)
        names = [s.name for s in self.specs]
        for label, given in (("RandomDataReaderInputShape", shapes), ("ranges", ranges)):
            for name in given or {}:
                if name not in names:
                    hint = did_you_mean(name, names)
                    raise CalibrationError(
                        f"{label}: {name!r} is not an input of the model{hint} "
                        f"(inputs: {', '.join(names)})"
                    )
        for label, value in (("RandomDataSamples", num_samples), ("RandomDataSeed", seed)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise CalibrationError(f"{label} must be a non-negative integer, got {value!r}")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.shapes = {s.name: self._shape(s, (shapes or {}).get(s.name)) for s in self.specs}
        per_sample = 0
        for spec in self.specs:
            count = 1
            for d in self.shapes[spec.name]:
                count *= d
            per_sample += count * spec.dtype.itemsize
        bound = max_array_bytes()
        if per_sample > bound:
            raise CalibrationError(
                f"random data: one sample of shapes {self.shapes} takes {per_sample} bytes, above "
                f"the {bound}-byte bound (half the available memory); give smaller shapes with "
                "RandomDataReaderInputShape"
            )
        self.ranges = {}
        for name, r in (ranges or {}).items():
            try:
                values = tuple(float(v) for v in r)
            except (TypeError, ValueError, OverflowError):
                values = ()
            if len(values) != 2 or not np.isfinite(values).all() or not values[0] < values[1]:
                raise CalibrationError(
                    f"RandomDataReaderInputDataRange[{name!r}] must be [low, high] with finite "
                    f"low < high, got {r!r}"
                )
            spec = next(sp for sp in self.specs if sp.name == name)
            if np.issubdtype(spec.dtype, np.integer):
                info = np.iinfo(spec.dtype)
                if values[0] < info.min or values[1] > info.max + 1:
                    raise CalibrationError(
                        f"RandomDataReaderInputDataRange[{name!r}] = {list(r)} does not fit the "
                        f"input's type {spec.dtype} ([{info.min}, {info.max + 1}))"
                    )
            self.ranges[name] = values
        self.rewind()

    @staticmethod
    def _shape(spec: InputSpec, given: Sequence[int] | None) -> tuple[int, ...]:
        if given is not None:
            ok = isinstance(given, Sequence) and not isinstance(given, (str, bytes))
            if not ok or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool) and 1 <= d < 2**31
                for d in given
            ):
                raise CalibrationError(
                    f"RandomDataReaderInputShape[{spec.name!r}] = {given!r}: expected a list of "
                    "positive integer dimensions (each below 2^31)"
                )
        if spec.dims is None:
            if given is None:
                raise CalibrationError(
                    f"input {spec.name!r} has no shape in the model; give one in "
                    "RandomDataReaderInputShape"
                )
            return tuple(int(d) for d in given)
        if given is None:
            return tuple(d if isinstance(d, int) and d > 0 else 1 for d in spec.dims)
        given = [int(d) for d in given]
        ok = len(given) == len(spec.dims) and all(
            not (isinstance(w, int) and w > 0) or w == g
            for w, g in zip(spec.dims, given, strict=True)
        )
        if not ok:
            raise CalibrationError(
                f"RandomDataReaderInputShape[{spec.name!r}] = {given} does not match the model "
                f"input {spec.describe()}"
            )
        return tuple(given)

    def __len__(self) -> int:
        return self.num_samples

    def rewind(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self._index = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._index >= self.num_samples:
            return None
        self._index += 1
        feed = {}
        for spec in self.specs:
            shape = self.shapes[spec.name]
            if spec.dtype == np.bool_:
                feed[spec.name] = self._rng.random(shape) < 0.5
            elif np.issubdtype(spec.dtype, np.integer):
                low, high = self.ranges.get(spec.name, (0, 2))
                feed[spec.name] = self._rng.integers(
                    int(low), int(high), size=shape, dtype=spec.dtype
                )
            else:
                low, high = self.ranges.get(spec.name, (0.0, 1.0))
                feed[spec.name] = self._rng.uniform(low, high, size=shape).astype(spec.dtype)
        return feed


#: Feeds read from a reader of unknown length when ``CalibDataSize`` is 0 ("all"): a reader that
#: never returns None would otherwise be consumed forever. Raise it with ``CalibDataSize``.
DEFAULT_MAX_FEEDS = 10_000


class GuardedReader:
    """A user's reader as calibration consumes it: exceptions from ``get_next()`` become
    :class:`CalibrationError` naming the reader, no more than ``CalibDataSize`` feeds are read
    (when set), and a reader of unknown length stops after :data:`DEFAULT_MAX_FEEDS` feeds (with
    a warning naming ``CalibDataSize``) unless ``CalibDataSize`` asks for a number of samples.

    ``CalibDataSize`` bounds every sample read from the reader, not only calibration's: the
    fidelity verdict's held-out samples and the preparation's measured ones come out of the same
    stream (:class:`~quark_onnx.calibration.sources.CalibrationSource`), so a user's sample cap
    is a cap on what is read."""

    #: :func:`reader_for` takes it as it is (it is already guarded and bound)
    calibration_ready = True

    def __init__(self, reader: Any, options: ExtraOptions, specs: Sequence[InputSpec] = ()) -> None:
        self._reader = reader
        #: the model's first input says how many samples a feed holds (axis 0 when dynamic)
        self._first = specs[0] if specs else None
        self._rows = 0
        #: the user's reader class, for messages about what it returned
        self.reader_name = type(reader).__name__
        self._feeds = 0
        known = getattr(reader, "num_samples", None)
        if not isinstance(known, int) and hasattr(reader, "__len__"):
            with contextlib.suppress(Exception):  # a broken __len__: length unknown
                known = len(reader)
        self._cap = None if options.CalibDataSize or isinstance(known, int) else DEFAULT_MAX_FEEDS
        #: the user's sample cap (0: none): the reader ends there, without a warning
        self._limit = max(0, int(options.CalibDataSize))
        self.num_samples = getattr(reader, "num_samples", None)
        if self._limit and isinstance(self.num_samples, int):
            self.num_samples = min(self.num_samples, self._limit)

    def __getattr__(self, name: str) -> Any:  # bind, rewind, ... of the wrapped reader
        return getattr(self._reader, name)

    def get_next(self) -> Any:
        if self._cap is not None and self._feeds >= self._cap:
            logger.warning(
                "calibration data reader %s: stopped after %d feeds (it has no known length "
                "and CalibDataSize is 0); set the extra option CalibDataSize to read more or "
                "fewer samples",
                type(self._reader).__name__,
                self._cap,
            )
            self._cap = None
            self._feeds = -1  # stopped: every later call returns None
            return None
        if self._feeds < 0 or (self._limit and self._rows >= self._limit):
            return None
        try:
            feed = self._reader.get_next()
        except (CalibrationError, KeyboardInterrupt):
            raise
        except Exception as exc:
            raise CalibrationError(
                f"calibration data reader {type(self._reader).__name__}.get_next() raised "
                f"{type(exc).__name__}: {str(exc)[:200]} (after {self._feeds} feeds); fix the "
                "reader"
            ) from exc
        if feed is not None:
            self._feeds += 1
            if self._limit:
                feed = self._within_limit(feed)
        return feed

    def _within_limit(self, feed: Any) -> Any:
        """``feed``, counted against ``CalibDataSize``: one that crosses it is cut on a dynamic
        batch axis (as calibration cuts it), so that no more samples than asked are read."""
        first = self._first
        value = feed.get(first.name) if first is not None and isinstance(feed, Mapping) else None
        if not (first is not None and first.batch_dynamic and isinstance(value, np.ndarray)):
            self._rows += 1
            return feed
        rows = int(value.shape[0]) if value.ndim > 0 else 1
        keep = self._limit - self._rows
        self._rows += min(rows, keep)
        if rows <= keep:
            return feed
        return {
            k: v[:keep] if isinstance(v, np.ndarray) and v.ndim > 0 else v for k, v in feed.items()
        }


def reader_for(model: onnx.ModelProto, reader: Any, options: ExtraOptions) -> CalibrationDataReader:
    """The reader calibration uses.

    With no ``reader``, ``options.UseRandomData`` gives a :class:`RandomDataReader`
    (``RandomDataSamples`` feeds, ``RandomDataSeed``, ``RandomDataReaderInputShape``,
    ``RandomDataReaderInputDataRange``). A given ``reader`` always wins over random data: real
    samples set real ranges, and the samples the quantizer keeps for bias correction live in it.
    Otherwise ``reader`` is used: a reader object, a path to a ``.npz``/``.npy`` file, a mapping of
    stacked arrays or a list of feeds. ``None`` is an error. A reader already built for
    calibration (a :class:`GuardedReader`, a :class:`~quark_onnx.calibration.sources.
    CalibrationSource`) is returned as it is: calibration never replaces the quantizer's source.
    """
    if getattr(type(reader), "calibration_ready", False):
        return reader
    if options.UseRandomData and reader is None:
        return RandomDataReader(
            model,
            num_samples=options.RandomDataSamples,
            seed=options.RandomDataSeed,
            shapes=options.RandomDataReaderInputShape or None,
            ranges=options.RandomDataReaderInputDataRange or None,
        )
    if reader is None:
        raise CalibrationError(
            "no calibration data: pass a calibration data reader (or a .npz path), or set the "
            "extra option UseRandomData=True to calibrate on random data"
        )
    if isinstance(reader, (str, os.PathLike)):
        reader = NpzDataReader(reader)
    elif isinstance(reader, Mapping) or (
        isinstance(reader, Sequence) and not isinstance(reader, (str, bytes))
    ):
        reader = ArrayDataReader(reader)
    if not callable(getattr(reader, "get_next", None)):
        raise CalibrationError(
            f"calibration data reader {type(reader).__name__} has no get_next() method"
        )
    bind = getattr(reader, "bind", None)
    if callable(bind):
        bind(model)
    return GuardedReader(reader, options, input_specs(model))
