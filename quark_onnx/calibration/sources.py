"""One calibration source: the readers of the API, the CLI and the comparison, built one way.

:func:`open_reader` turns what a user gives into a reader (onnxruntime's ``get_next()``
protocol), the same way everywhere:

* a reader object: used as it is;
* a mapping of arrays stacked over samples on axis 0, or a list of feeds:
  :class:`~quark_onnx.calibration.readers.ArrayDataReader`;
* a folder of images (with a :class:`~quark_onnx.calibration.image_spec.PreprocessSpec`):
  :class:`~quark_onnx.calibration.image_reader.ImageFolderDataReader`;
* a ``.npz``/``.npy`` file (:func:`npz_reader`): a single-input model reads the only array, the
  one named like the input, or ``x``; a multi-input model one array per input, named like it;
* nothing, with ``UseRandomData``: :func:`random_reader`.

:func:`calibration_source` is what :class:`~quark_onnx.pipeline.quantizer.ModelQuantizer` calibrates
from: that reader behind :class:`~quark_onnx.calibration.readers.GuardedReader`, wrapped in a
:class:`CalibrationSource` that lets the first samples be looked at before calibration and keeps
the first few for the stages after it. Calibration takes the source as it is
(:func:`~quark_onnx.calibration.readers.reader_for` never wraps or replaces a built source), so the
samples the accuracy stages replay are the ones calibration read, random data included.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quark_onnx.calibration.readers import (
    ArrayDataReader,
    GuardedReader,
    NpzDataReader,
    RandomDataReader,
    input_specs,
    load_array,
    npz_keys,
    validate_feed,
)
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import CalibrationError, ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "CalibrationSource",
    "calibration_source",
    "npz_reader",
    "open_reader",
    "random_reader",
]


def npz_reader(
    path: str | os.PathLike, model: onnx.ModelProto, limit: int | None = None
) -> ArrayDataReader:
    """A reader over a ``.npz``/``.npy`` file for ``model`` (only its graph inputs are read).

    A single-input model reads the archive's only array, the array named like the input, or
    ``x``. A multi-input model needs one array per input, named like the inputs. ``limit``
    keeps the first samples only.

    Raises:
        CalibrationError: an input has no array (the message lists both), or the file is not a
            readable archive.
    """
    names = [spec.name for spec in input_specs(model)]
    if len(names) <= 1:
        return NpzDataReader(path, input_name=names[0] if names else None, limit=limit)
    keys = npz_keys(path) or []
    missing = [n for n in names if n not in keys]
    if missing:
        raise CalibrationError(
            f"{path}: the model has inputs {names}; the archive has arrays {keys} "
            f"(missing {missing}): save one array per input, named like the input"
        )
    return ArrayDataReader({n: load_array(path, n, limit or None) for n in names})


def random_reader(
    model: onnx.ModelProto,
    options: ExtraOptions | None = None,
    *,
    samples: int | None = None,
    seed: int | None = None,
) -> RandomDataReader:
    """``UseRandomData``'s reader: ``RandomDataSamples`` feeds (or ``samples``) drawn with
    ``RandomDataSeed`` (or ``seed``), shaped by ``RandomDataReaderInputShape`` and ranged by
    ``RandomDataReaderInputDataRange``. The first ``n`` feeds do not depend on ``samples``."""
    options = options or ExtraOptions()
    return RandomDataReader(
        model,
        num_samples=options.RandomDataSamples if samples is None else samples,
        seed=options.RandomDataSeed if seed is None else seed,
        shapes=options.RandomDataReaderInputShape or None,
        ranges=options.RandomDataReaderInputDataRange or None,
    )


def open_reader(
    data: Any,
    model: onnx.ModelProto,
    options: ExtraOptions | None = None,
    *,
    model_path: str | os.PathLike | None = None,
    preprocess: Any = None,
    limit: int | None = None,
    random_samples: int | None = None,
) -> Any:
    """The reader of ``data`` for ``model`` (see the module docstring); None when there is no
    data and ``UseRandomData`` is not set (a saved calibration result).

    Args:
        data: a reader, arrays, a ``.npz``/``.npy`` path, an image folder, or None.
        model: the model, read for its graph inputs only (:func:`quark_onnx.model_files.
            signature_proto` is enough).
        options: the extra options (``UseRandomData`` and the random-data settings).
        model_path: the model's file, which the image reader names in its messages.
        preprocess: the image pre-processing (a ``PreprocessSpec``), for an image folder.
        limit: read at most this many samples of a file or folder.
        random_samples: random data: this many feeds instead of ``RandomDataSamples``.
    """
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.is_dir():
            if preprocess is None:
                raise ConfigError(
                    f"{path}: an image folder needs its pre-processing: pass an "
                    "ImageFolderDataReader with a PreprocessSpec (the CLI's --preprocess)"
                )
            from quark_onnx.calibration.image_reader import ImageFolderDataReader

            source = model_path if model_path is not None else model
            return ImageFolderDataReader(path, source, preprocess, limit=limit)
        return npz_reader(path, model, limit)
    if isinstance(data, Mapping) or (
        isinstance(data, Sequence) and not isinstance(data, (str, bytes))
    ):
        return ArrayDataReader(data)
    if data is None and options is not None and options.UseRandomData:
        return random_reader(model, options, samples=random_samples)
    return data


class CalibrationSource:
    """The calibration data of one quantization: the first samples can be looked at without
    losing them (:meth:`peek`), and the first ``keep`` samples are kept (bounded memory) for the
    stages that run after calibration (bias correction, AdaRound, error analysis)."""

    #: :func:`~quark_onnx.calibration.readers.reader_for` takes it as it is
    calibration_ready = True

    def __init__(
        self,
        reader: Any,
        keep: int = 0,
        specs: Sequence[Any] = (),
        fresh: Callable[[int], list[dict[str, np.ndarray]]] | None = None,
    ) -> None:
        self._reader = reader
        # random data: the verdict's samples are drawn anew instead of taken from calibration
        self._fresh = fresh
        self._specs = list(specs)  # the model's inputs: peeked feeds are checked against them
        self._ahead: list[dict[str, np.ndarray]] = []  # read by peek, not yet by get_next
        self._ended = False
        self._keep = keep
        self.kept: list[dict[str, np.ndarray]] = []
        # the wrapped reader's length, so that calibration's guard does not cap a reader of
        # known length (``--random-calib 100000`` reads 100,000 samples, not the default cap)
        self.num_samples: int | None = getattr(reader, "num_samples", None)

    def _remember(self, feed: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
        if feed is not None and len(self.kept) < self._keep:
            self.kept.append({k: np.array(v, copy=True) for k, v in feed.items()})
        return feed

    def peek(self, count: int = 1) -> list[dict[str, np.ndarray]]:
        """Copies of the first ``count`` samples (fewer if the reader has fewer); get_next still
        returns them, in order.

        Raises:
            CalibrationError: a peeked feed is not a dict of the model's inputs (the message
                calibration would give for it).
        """
        while len(self._ahead) < count and not self._ended:
            feed = self._reader.get_next()
            if feed is None:
                self._ended = True
            else:
                if self._specs:
                    try:
                        validate_feed(feed, self._specs, len(self._ahead), len(self._ahead))
                    except CalibrationError as exc:
                        name = getattr(self._reader, "reader_name", type(self._reader).__name__)
                        raise CalibrationError(f"calibration data reader {name}: {exc}") from exc
                self._ahead.append(feed)
        return [{k: np.array(v, copy=True) for k, v in f.items()} for f in self._ahead[:count]]

    def hold_out(self, count: int) -> list[dict[str, np.ndarray]]:
        """Take up to ``count`` samples out of the stream for the fidelity verdict: calibration,
        the accuracy stages and every choice made on calibration samples never see them.

        The split is fixed and reproducible: every second sample of the first ``2 * count``
        (indices 1, 3, 5, ...), so that a source ordered by class or scene lends the verdict
        samples from its whole beginning and calibration keeps the others beside them. At most a
        quarter of a source of known length is held out (``count`` is lowered to fit), so that
        calibration keeps most of a small set; the caller warns when few are left to judge.
        The held-out samples count against ``CalibDataSize``: with a cap of n samples, n are read
        in all and the verdict holds out up to n // 4 of them. Random data (``UseRandomData``)
        loses none: ``count`` more feeds (at most ``RandomDataSamples`` and ``CalibDataSize``)
        are drawn with the next seed.
        """
        if count <= 0:
            return []
        if self._fresh is not None:
            return self._fresh(count)
        self.peek(2 * count + 1)  # one more: a source of exactly 2 * count samples is known
        total = len(self._ahead) if self._ended else self.num_samples
        if total is not None:
            count = min(count, total // 4)
        held = self._ahead[1 : 2 * count : 2]
        self._ahead = self._ahead[0 : 2 * count : 2] + self._ahead[2 * count :]
        if self.num_samples is not None:
            self.num_samples = max(self.num_samples - len(held), 0)
        return [{k: np.array(v, copy=True) for k, v in f.items()} for f in held]

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._ahead:
            return self._remember(self._ahead.pop(0))
        if self._ended:
            return None
        return self._remember(self._reader.get_next())


def calibration_source(
    reader: Any,
    npz_path: str | os.PathLike | None,
    options: ExtraOptions,
    *,
    model: onnx.ModelProto,
    keep: int = 0,
) -> CalibrationSource | None:
    """The source :class:`~quark_onnx.pipeline.quantizer.ModelQuantizer` calibrates from (the API's
    ``calibration_data_reader`` or ``calibration_data_path``; random data with
    ``UseRandomData``); None when there is neither (a saved calibration result).

    Raises:
        ConfigError: both a reader and a path, or a reader without ``get_next()``.
    """
    if reader is not None and npz_path is not None:
        raise ConfigError("give either calibration_data_reader or calibration_data_path, not both")
    given = reader if npz_path is None else npz_path
    if given is not None and options.UseRandomData:
        # The Vitis AI documentation's XINT8 snippet sets UseRandomData and users pass their data
        # anyway: ranges taken from random inputs say nothing about the real ones, and the kept
        # samples that bias correction replays would be noise too, so the real data is used.
        logger.warning(
            "UseRandomData is set but calibration data was given: calibrating on the given data "
            "(unset UseRandomData to silence this)"
        )
    # the API's path is a file (an image folder needs a PreprocessSpec: an ImageFolderDataReader)
    data = open_reader(npz_path, model) if npz_path is not None else reader
    fresh = None
    if isinstance(data, Mapping):
        data = ArrayDataReader(data)
    elif data is None:
        data = open_reader(None, model, options)  # kept samples then serve bias correction too
        if data is not None:

            def fresh(count: int) -> list[dict[str, np.ndarray]]:
                # as many as calibration reads at most: random data judges no better with more
                count = min(count, options.RandomDataSamples, options.CalibDataSize or count)
                seed = (options.RandomDataSeed + 1) % 2**64
                reader = random_reader(model, options, samples=count, seed=seed)
                return list(iter(reader.get_next, None))

    if data is None:
        return None
    if not callable(getattr(data, "get_next", None)):
        raise ConfigError(
            f"calibration_data_reader must have get_next() (onnxruntime's "
            f"CalibrationDataReader protocol); got {type(data).__name__}"
        )
    if callable(getattr(data, "bind", None)):
        data.bind(model)  # readers that take their input name from the model (.npz files)
    return CalibrationSource(
        GuardedReader(data, options, input_specs(model)),
        keep=keep,
        specs=input_specs(model),
        fresh=fresh,
    )
