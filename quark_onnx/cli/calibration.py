"""Calibration data of one model: the reader of ``--calib`` (``.npz``/``.npy`` or an image
folder), the samples the float-vs-quantized comparison runs on, and input shapes fixed from the
data."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quark_onnx.cli.settings import QuantizeSettings

logger = logging.getLogger("quark_onnx.cli")

DEFAULT_COMPARE_SAMPLES = 16
#: Input values the default comparison runs through at most (32 ImageNet-sized samples): a
#: 512x896 segmenter compares 3 samples, whose QDQ simulation costs as much as 16 classifier ones.
COMPARE_BUDGET = 32 * 3 * 224 * 224


def model_inputs(model: str | os.PathLike) -> list[Any]:
    """The graph inputs of ``model`` (read without its external data)."""
    from quark_onnx.calibration.readers import input_specs

    return input_specs(_signature(model))


def _signature(model: str | os.PathLike) -> Any:
    """``model`` without its external data: the readers read only its graph inputs."""
    from quark_onnx.model_files.load import read_proto

    return read_proto(model)


def npz_reader(path: str | os.PathLike, model: str | os.PathLike, limit: int | None = None) -> Any:
    """A reader over a ``.npz``/``.npy`` file for ``model``
    (:func:`quark_onnx.calibration.sources.npz_reader`, as the API reads ``calibration_data_path``).
    """
    from quark_onnx.calibration.sources import npz_reader as reader

    return reader(path, _signature(model), limit)


def calibration_reader(settings: QuantizeSettings, model: str | os.PathLike, limit: int | None):
    """The reader of ``--calib`` for ``model`` (None for random or saved calibration)."""
    if settings.calib is None:
        return None
    from quark_onnx.calibration.sources import open_reader

    calib = Path(settings.calib)
    preprocess = settings.preprocess_spec() if calib.is_dir() else None
    return open_reader(
        calib, _signature(model), model_path=model, preprocess=preprocess, limit=limit
    )


def preparation_samples_path(result: Path) -> Path:
    """Where the samples the preparation measured are saved beside a calibration result:
    ``NAME.calibration.json`` -> ``NAME.calibration.npz``."""
    return result.with_name(result.stem + ".npz")


def save_preparation_samples(
    settings: QuantizeSettings, qconfig: Any, model: str | os.PathLike, path: Path
) -> bool:
    """Write the samples the preparation passes measured on (the first ``FidelitySamples``
    after the held-out ones, as the quantizer took them) to ``path``, for ``--load-calibration``.

    Why: several preparation passes decide on those samples (cross-layer equalization's gate,
    FoldConstantChannels, the activation equalizations), so a later run without data would
    prepare another model and the saved result, which is for the prepared model, would not fit
    it. With these samples the later run prepares the same model. Returns False when there
    is no data (nothing written).
    """
    import numpy as np

    from quark_onnx.calibration.sources import calibration_source
    from quark_onnx.model_files.files import atomic_write_bytes

    options = qconfig.resolved_options()
    source = calibration_source(
        calibration_reader(settings, model, settings.calib_limit),
        None,
        options,
        model=_signature(model),
    )
    if source is None:
        return False
    if options.FidelityCheck:
        source.hold_out(options.FidelityHoldout)
    samples = source.peek(options.FidelitySamples if options.FidelityCheck else 1)
    if not samples:
        return False
    import io

    arrays = {
        name: np.concatenate([np.asarray(s[name]) for s in samples], axis=0) for name in samples[0]
    }
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())
    return True


def saved_samples_reader(
    settings: QuantizeSettings, qconfig: Any, model: str | os.PathLike, result: Path | None
) -> Any:
    """With ``--load-calibration`` and no data: a reader over the preparation samples saved
    beside the result (:func:`save_preparation_samples`), none held out so that the preparation
    measures the very samples it measured when the result was saved; None without them."""
    if result is None or settings.calib is not None or settings.random_samples is not None:
        return None
    samples = preparation_samples_path(result)
    if not os.path.lexists(samples):
        return None
    qconfig.extra_options["FidelityHoldout"] = 0
    return npz_reader(samples, model)


def compare_count(settings: QuantizeSettings) -> int:
    """The most samples the comparison may take (the default may take fewer: _budgeted)."""
    count = settings.compare_samples
    if count is None:
        count = DEFAULT_COMPARE_SAMPLES
    if settings.calib_limit:
        count = min(count, settings.calib_limit)
    return max(count, 0)


def budgeted(settings: QuantizeSettings, feeds: Iterator[dict[str, Any]]) -> Iterator[dict]:
    """``feeds``, cut to the input-value budget of the default comparison (an explicit
    ``--compare-samples`` is taken as it is)."""
    if settings.compare_samples is not None:
        yield from feeds
        return
    first = next(feeds, None)
    if first is None:
        return
    values = max(1, sum(int(getattr(v, "size", 1)) for v in first.values()))
    count = max(1, COMPARE_BUDGET // values)
    yield first
    for _, feed in zip(range(count - 1), feeds, strict=False):
        yield feed


def comparison_feeds(
    settings: QuantizeSettings, qconfig: Any, model: str | os.PathLike
) -> Iterator[dict[str, Any]] | None:
    """The first ``compare_samples`` calibration samples (the same as calibration saw first), or
    None when there is no data (a saved calibration result without ``--calib``)."""
    count = compare_count(settings)
    if count <= 0:
        return None
    options = qconfig.resolved_options()
    if options.UseRandomData:
        from quark_onnx.calibration.sources import random_reader

        samples = min(count, options.RandomDataSamples)
        reader: Any = random_reader(_signature(model), options, samples=samples)
    else:
        reader = calibration_reader(settings, model, count)
        if reader is None:
            return None
    return iter(reader.get_next, None)


def calibration_shapes(
    settings: QuantizeSettings, qconfig: Any, model: str | os.PathLike
) -> tuple[dict[str, list[int]], str] | None:
    """The one static shape the calibration data give each dynamic model input, and where it
    comes from; None when the inputs are static or the data have no single static shape.

    An image folder has one when the pre-processing fixes the size (``size=HxW`` with ``stretch``,
    ``fit``, ``short``, ``height``, or a crop); an ``.npz`` array holds samples of one shape along
    axis 0; random data use ``RandomDataReaderInputShape`` (dynamic dims otherwise 1). Saved
    calibration statistics (``--load-calibration`` alone) carry no shapes.
    """
    import numpy as np

    specs = model_inputs(model)
    dynamic = [s for s in specs if s.dims is None or not all(isinstance(d, int) for d in s.dims)]
    if not dynamic:
        return None
    if settings.calib is not None and Path(settings.calib).is_dir():
        spec = settings.preprocess_spec()
        shape = spec.output_shape()
        if len(specs) != 1 or any(d is None for d in shape):
            return None
        return {specs[0].name: [int(d) for d in shape]}, f"--preprocess {spec.to_string()!r}"
    options = qconfig.resolved_options()
    if settings.calib is not None:
        source = f"--calib {Path(settings.calib).name}"
        reader = calibration_reader(settings, model, 1)
    elif options.UseRandomData:
        from quark_onnx.calibration.sources import random_reader

        source = "random calibration data (RandomDataReaderInputShape)"
        reader = random_reader(_signature(model), options, samples=1)
    else:
        return None
    if callable(getattr(reader, "bind", None)):
        reader.bind(_signature(model))
    first = reader.get_next()
    if not first:
        return None
    # every sample of an .npz array or of random data has the first sample's shape (batch 1)
    shapes = {s.name: [1, *list(np.shape(first[s.name]))[1:]] for s in dynamic if s.name in first}
    if len(shapes) != len(dynamic):
        return None
    return shapes, source


def apply_calibration_shapes(
    settings: QuantizeSettings, qconfig: Any, model: str | os.PathLike, name: str
) -> str | None:
    """Set ``FixShapes`` from :func:`calibration_shapes` when asked (``--fix-shapes-from-calib``;
    by default for NPU configs such as XINT8) and FixShapes is not set already. Returns the
    sentence the report states, or None. Without the flag, a dynamic model with one calibration
    shape is told how to fix it (a warning)."""
    options = qconfig.resolved_options()
    if options.FixShapes:
        return None
    found = calibration_shapes(settings, qconfig, model)
    if found is None:
        _free_size_hint(settings, model, name)
        return None
    shapes, source = found
    text = ";".join(f"{k}:[{','.join(str(d) for d in v)}]" for k, v in shapes.items())
    wanted = settings.fix_shapes_from_calib
    if wanted is None:
        wanted = bool(qconfig.enable_npu_cnn)
    if not wanted:
        logger.warning(
            "%s: the model has dynamic input shapes and the calibration data one static shape; "
            "--fix-shapes-from-calib (or --set FixShapes='%s') writes it static, as the NPU needs",
            name,
            text,
        )
        return None
    qconfig.extra_options["FixShapes"] = text
    why = (
        "--fix-shapes-from-calib"
        if settings.fix_shapes_from_calib
        else "default for NPU presets; --no-fix-shapes-from-calib keeps them dynamic"
    )
    return f"input shapes fixed from the calibration data ({source}): FixShapes={text!r} ({why})"


def _free_size_hint(settings: QuantizeSettings, model: str | os.PathLike, name: str) -> None:
    """Warn when a dynamic model stays dynamic because the image spec's size follows each image
    (a text recognizer's free width), naming a spec of one size that would make it static."""
    if settings.calib is None or not Path(settings.calib).is_dir():
        return
    specs = model_inputs(model)
    dynamic = [s for s in specs if s.dims is None or not all(isinstance(d, int) for d in s.dims)]
    spec = settings.preprocess_spec()
    if len(specs) != 1 or not dynamic or None not in spec.output_shape():
        return
    better = spec.static_variant()
    fix = (
        f"--preprocess '{better.to_string()}' (each image padded to that width) makes it static"
        if better is not None
        else "a spec of one size (size=HxW with resize=stretch, fit, short or height, or a "
        "crop) makes it static"
    )
    logger.warning(
        "%s: --preprocess '%s' gives the images different sizes, so the dynamic input %r stays "
        "dynamic and the model is not Vitis AI-ready; %s, as does --set FixShapes='%s:[...]'",
        name,
        spec.to_string(),
        specs[0].name,
        fix,
        specs[0].name,
    )
