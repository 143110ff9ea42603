"""The ``quark-onnx`` command line (also ``python -m quark_onnx``).

Subcommands:

``quantize MODEL_OR_FOLDER... -o OUT_DIR``
    Quantize one or many models with a preset (``--config``, default XINT8) plus ``--set
    KEY=VALUE`` overrides. For each model ``NAME.onnx`` it writes ``OUT_DIR/NAME.onnx``, the JSON
    report ``OUT_DIR/NAME.report.json`` (:meth:`QuantizationReport.save`), a readable summary
    ``OUT_DIR/NAME.report.txt`` and, when data allows a float-vs-quantized comparison,
    ``OUT_DIR/NAME.compare.json`` (:func:`quark_onnx.compare.compare_models` on the first
    ``--compare-samples`` calibration samples). A failing model prints one line ``error: MODEL:
    MESSAGE`` (the traceback only with ``--debug``) and the others go on; a summary table ends the
    run; the exit code is 1 when any model failed. ``--jobs N`` quantizes N models at once in
    processes started with the ``spawn`` method (onnxruntime and ``fork`` do not mix); each model
    is quantized by the same code with the same settings whatever N is, so outputs are identical.
``check MODEL...``
    The Vitis AI readiness check (:func:`quark_onnx.check.check`); exit code 1 when a model is not
    ready (or cannot be read).
``compare FLOAT QUANTIZED``
    Float vs quantized on data: per-output SQNR / cosine / top-1 agreement and per-layer SQNR of
    the quantized tensors, worst first.
``export MODEL --format recipe|gguf|onnx -o OUT``
    Write a quantized (QDQ) model in another format: ``recipe`` (a folder: the configuration as
    JSON and every tensor's scale, zero point and codes in safetensors, :func:`quark_onnx.recipe.
    save_recipe`; needs ``--float-model`` and the settings it was quantized with, from
    ``--report MODEL.report.json`` or ``--config``/``--set``), ``gguf`` (weight-only tensors,
    :func:`quark_onnx.gguf_export.export_gguf`; needs the optional ``gguf`` package) or ``onnx``
    (the QDQ model itself, validated and re-written).
``import SOURCE -o OUT``
    ``SOURCE`` a QDQ model (this project's, onnxruntime's or Quark's standard QDQ): write the
    recipe folder ``OUT`` (with the float model, :func:`quark_onnx.recipe.import_recipe`).
    ``SOURCE`` a recipe folder: rebuild the quantized model ``OUT`` (``.onnx``) without
    calibration (:func:`quark_onnx.recipe.load_recipe`; ``--float-model`` unless the recipe was
    imported).
``presets`` / ``options``
    The presets and their settings; every extra option with its type, default and meaning.

Exit codes: 0 success (``quantize`` writes and reports a model that is not Vitis AI-ready and
exits 0 unless ``--require-ready``); 1 a model failed (with ``--require-fidelity`` also a model
whose outputs do not follow the float model's: it is not written), is not ready (``check``,
``quantize --require-ready``), or a comparison failed;
2 a usage or configuration error (unknown preset or option, bad flag value), reported as one line
naming the closest valid name.

Values of ``--set KEY=VALUE`` are read as JSON literals (``true``, ``3``, ``0.5``, ``[1, 2]``,
``{"a": [0, 1]}``), ``True``/``False``/``None`` as in Python, and anything else as a string.
``KEY`` is a :class:`~quark_onnx.config.QuantizationConfig` field (``include_cle``,
``calibrate_method``, ...) or an extra option (``ActivationSymmetric``, ...).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from quark_onnx import model_io
from quark_onnx.errors import CalibrationError, ConfigError, ModelSaveError, QuarkOnnxError

logger = logging.getLogger("quark_onnx.cli")

#: Exit codes.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

_NPZ_SUFFIXES = (".npz", ".npy")
_DEFAULT_PRESET = "XINT8"
_DEFAULT_COMPARE_SAMPLES = 16
#: Input values the default comparison runs through at most (32 ImageNet-sized samples): a
#: 512x896 segmenter compares 3 samples, whose QDQ simulation costs as much as 16 classifier ones.
_COMPARE_BUDGET = 32 * 3 * 224 * 224


# ------------------------------------------------------------------------------------------------
# Settings: preset + --set + flags -> QuantizationConfig
# ------------------------------------------------------------------------------------------------


def parse_value(text: str) -> Any:
    """A ``--set`` value: a JSON literal, ``True``/``False``/``None`` (Python spelling), else the
    text itself (a string)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    except RecursionError:
        raise ConfigError(
            f"--set value {text[:40]!r}...: nested deeper than the JSON parser accepts"
        ) from None
    python_literals = {"true": True, "false": False, "none": None}
    if text.strip().lower() in python_literals:
        return python_literals[text.strip().lower()]
    return text


def parse_assignments(items: Sequence[str]) -> list[tuple[str, Any]]:
    """``["KEY=VALUE", ...]`` -> ``[(key, parsed value), ...]`` (see :func:`parse_value`).

    Raises:
        ConfigError: an item is not ``KEY=VALUE``.
    """
    pairs: list[tuple[str, Any]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"--set {item!r}: expected KEY=VALUE (e.g. --set include_cle=true or "
                "--set ActivationSymmetric=false)"
            )
        pairs.append((key, parse_value(raw.strip())))
    return pairs


def _config_field_names() -> tuple[str, ...]:
    from quark_onnx.config import QuantizationConfig

    return tuple(
        f.name for f in dataclasses.fields(QuantizationConfig) if f.name != "extra_options"
    )


def apply_assignments(qconfig: Any, pairs: Sequence[tuple[str, Any]]) -> None:
    """Apply ``--set`` pairs to a QuantizationConfig: config fields are assigned (and normalised
    by the config), other keys go to ``extra_options``. ``extra_options={...}`` merges a dict.

    Raises:
        ConfigError: a key is neither a config field nor an extra option (the closest valid name
            of either kind is named), or a value has the wrong type.
    """
    from quark_onnx.options import UNSUPPORTED_QUARK_OPTIONS, closest_name, option_names

    fields = _config_field_names()
    options = option_names()
    for key, value in pairs:
        if key in fields:
            setattr(qconfig, key, value)
        elif key == "extra_options":
            if not isinstance(value, dict):
                raise ConfigError(f"--set extra_options=...: expected a JSON object, got {value!r}")
            qconfig.extra_options.update(value)
        elif key in options or key in UNSUPPORTED_QUARK_OPTIONS:
            qconfig.extra_options[key] = value
        else:
            close = closest_name(key, (*fields, *options))
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(
                f"unknown setting {key!r} in --set{hint} (a QuantizationConfig field or an extra "
                "option: see `quark-onnx options`)"
            )
    qconfig.validate()


@dataclass(frozen=True)
class QuantizeSettings:
    """Everything a worker needs to quantize one model exactly as the others (picklable).

    The QuantizationConfig is rebuilt from these in every process, so ``--jobs`` cannot change
    what a model is quantized with.
    """

    preset: str = _DEFAULT_PRESET
    assignments: tuple[tuple[str, Any], ...] = ()
    exclude: tuple[str, ...] = ()
    random_samples: int | None = None
    calib: str | None = None
    preprocess: str | None = None
    calib_limit: int | None = None
    #: None: _DEFAULT_COMPARE_SAMPLES, fewer for large inputs (_COMPARE_BUDGET)
    compare_samples: int | None = None
    compare_layers: bool = False
    #: FixShapes from the calibration data's one static shape (None: on for NPU configs, XINT8)
    fix_shapes_from_calib: bool | None = None
    save_calibration: bool = False
    load_calibration: str | None = None
    overwrite: bool = False
    log_level: int = logging.WARNING
    require_fidelity: bool = False
    require_ready: bool = False
    # how calibration is spread (not what is computed): the output does not depend on these
    calib_shards: int = 1
    shard_backend: str = "processes"

    def build_config(self) -> Any:
        """The QuantizationConfig: the preset, then ``--set``, then the dedicated flags."""
        from quark_onnx.config import get_default_config

        qconfig = get_default_config(self.preset)
        apply_assignments(qconfig, self.assignments)
        if self.exclude:
            qconfig.nodes_to_exclude = [*qconfig.nodes_to_exclude, *self.exclude]
        if self.random_samples is not None:
            qconfig.extra_options["UseRandomData"] = True
            qconfig.extra_options["RandomDataSamples"] = self.random_samples
        if self.calib_limit is not None:
            qconfig.extra_options["CalibDataSize"] = self.calib_limit
        if self.require_fidelity:
            qconfig.extra_options["RequireFidelity"] = True
        qconfig.validate()
        return qconfig

    def preprocess_spec(self) -> Any:
        from quark_onnx.images import PreprocessSpec

        if self.preprocess is None:
            return PreprocessSpec()
        return PreprocessSpec.parse(self.preprocess)


# ------------------------------------------------------------------------------------------------
# Calibration data for one model
# ------------------------------------------------------------------------------------------------


def _model_inputs(model: str | os.PathLike) -> list[Any]:
    """The graph inputs of ``model`` (read without its external data)."""
    import onnx

    from quark_onnx.calibration.readers import input_specs
    from quark_onnx.model_io import load_model

    try:
        proto = onnx.load(str(model), load_external_data=False)
    except Exception:
        load_model(model, upgrade_opset=False)  # raises ModelLoadError with the precise reason
        raise
    return input_specs(proto)


def npz_reader(path: str | os.PathLike, model: str | os.PathLike, limit: int | None = None) -> Any:
    """A reader over a ``.npz``/``.npy`` file for ``model``.

    A single-input model reads the archive's only array, the array named like the input, or
    ``x``. A multi-input model needs one array per input, named like the inputs.
    """
    from quark_onnx.calibration import ArrayDataReader, NpzDataReader
    from quark_onnx.calibration.readers import load_array, npz_keys

    names = [s.name for s in _model_inputs(model)]
    if len(names) == 1:
        return NpzDataReader(path, input_name=names[0], limit=limit)
    keys = npz_keys(path) or []
    missing = [n for n in names if n not in keys]
    if missing:
        raise CalibrationError(
            f"{path}: the model has inputs {names}; the archive has arrays {keys} "
            f"(missing {missing}): save one array per input, named like the input"
        )
    return ArrayDataReader({n: load_array(path, n, limit or None) for n in names})


def calibration_reader(settings: QuantizeSettings, model: str | os.PathLike, limit: int | None):
    """The reader of ``--calib`` for ``model`` (None for random or saved calibration)."""
    if settings.calib is None:
        return None
    calib = Path(settings.calib)
    if calib.is_dir():
        from quark_onnx.images import ImageFolderDataReader

        return ImageFolderDataReader(calib, model, settings.preprocess_spec(), limit=limit)
    return npz_reader(calib, model, limit)


def _compare_count(settings: QuantizeSettings) -> int:
    """The most samples the comparison may take (the default may take fewer: _budgeted)."""
    count = settings.compare_samples
    if count is None:
        count = _DEFAULT_COMPARE_SAMPLES
    if settings.calib_limit:
        count = min(count, settings.calib_limit)
    return max(count, 0)


def _budgeted(settings: QuantizeSettings, feeds: Iterator[dict[str, Any]]) -> Iterator[dict]:
    """``feeds``, cut to the input-value budget of the default comparison (an explicit
    ``--compare-samples`` is taken as it is)."""
    if settings.compare_samples is not None:
        yield from feeds
        return
    first = next(feeds, None)
    if first is None:
        return
    values = max(1, sum(int(getattr(v, "size", 1)) for v in first.values()))
    count = max(1, _COMPARE_BUDGET // values)
    yield first
    for _, feed in zip(range(count - 1), feeds, strict=False):
        yield feed


def comparison_feeds(
    settings: QuantizeSettings, qconfig: Any, model: str | os.PathLike
) -> Iterator[dict[str, Any]] | None:
    """The first ``compare_samples`` calibration samples (the same as calibration saw first), or
    None when there is no data (a saved calibration result without ``--calib``)."""
    count = _compare_count(settings)
    if count <= 0:
        return None
    options = qconfig.resolved_options()
    if options.UseRandomData:
        import onnx

        from quark_onnx.calibration import RandomDataReader

        reader: Any = RandomDataReader(
            onnx.load(str(model), load_external_data=False),
            num_samples=min(count, options.RandomDataSamples),
            seed=options.RandomDataSeed,
            shapes=options.RandomDataReaderInputShape or None,
            ranges=options.RandomDataReaderInputDataRange or None,
        )
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

    specs = _model_inputs(model)
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
        import onnx

        from quark_onnx.calibration import RandomDataReader

        source = "random calibration data (RandomDataReaderInputShape)"
        reader = RandomDataReader(
            onnx.load(str(model), load_external_data=False),
            num_samples=1,
            seed=options.RandomDataSeed,
            shapes=options.RandomDataReaderInputShape or None,
            ranges=options.RandomDataReaderInputDataRange or None,
        )
    else:
        return None
    if callable(getattr(reader, "bind", None)):
        import onnx

        reader.bind(onnx.load(str(model), load_external_data=False))
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


# ------------------------------------------------------------------------------------------------
# One model (runs in the main process or in a worker)
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One model to quantize: its index in the batch, input path, output name and folder."""

    index: int
    model: str
    name: str
    out_dir: str
    settings: QuantizeSettings

    @property
    def output(self) -> Path:
        return Path(self.out_dir) / f"{self.name}.onnx"


@dataclass
class Outcome:
    """What happened to one model (picklable, returned by workers)."""

    index: int
    model: str
    name: str
    ok: bool
    seconds: float
    output: str | None = None
    quantized_nodes: int | None = None
    ready: bool | None = None
    faithful: bool | None = None
    output_sqnr_db: float | None = None
    output_cosine: float | None = None
    #: the first output's agreement: top-1 (score vectors) or per-pixel argmax (dense outputs)
    agreement: float | None = None
    agreement_kind: str | None = None
    compared_samples: int = 0
    message: str = ""
    traceback: str = ""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_message(model: str, exc: BaseException) -> str:
    """The message of the one ``error: MODEL: MESSAGE`` line (the model name not repeated)."""
    text = _one_line(str(exc)) or type(exc).__name__
    for prefix in (f"{model}: ", f"{Path(model).resolve()}: "):
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    if not isinstance(exc, QuarkOnnxError):
        text = (
            f"{type(exc).__name__}: {text} (internal error; rerun with --debug for the traceback)"
        )
    return text


def _exclude_warnings(job: Job, report: Any) -> None:
    excluded = {
        f["node"] for f in report.float_nodes if f.get("reason") == "excluded by nodes_to_exclude"
    }
    missing = [n for n in job.settings.exclude if n not in excluded]
    if not missing:
        return
    import onnx

    from quark_onnx.options import closest_name

    names = [n.name for n in onnx.load(job.model, load_external_data=False).graph.node if n.name]
    for name in missing:
        close = closest_name(name, names)
        hint = f"; did you mean {close!r}?" if close else ""
        logger.warning("%s: --exclude %r matches no node of the model%s", job.name, name, hint)


def quantize_one(job: Job) -> Outcome:
    """Quantize one model and write its outputs; every failure becomes an :class:`Outcome`."""
    start = time.perf_counter()
    outcome = Outcome(index=job.index, model=job.model, name=job.name, ok=False, seconds=0.0)
    try:
        _quantize_one(job, outcome)
        outcome.ok = True
    except Exception as exc:
        outcome.message = error_message(job.model, exc)
        outcome.traceback = traceback.format_exc()
        # nothing of a failed job is kept: the summary shows no output, readiness or accuracy
        outcome.output = outcome.ready = outcome.faithful = outcome.quantized_nodes = None
        outcome.agreement = outcome.agreement_kind = None
        outcome.output_sqnr_db = outcome.output_cosine = None
        outcome.compared_samples = 0
    outcome.seconds = time.perf_counter() - start
    return outcome


def _job_outputs(job: Job) -> list[Path]:
    """Every file a job writes into the output folder, data file before its model."""
    out_dir = Path(job.out_dir)
    names = [
        f"{job.name}.onnx.data",
        f"{job.name}.onnx",
        f"{job.name}.report.json",
        f"{job.name}.compare.json",
        f"{job.name}.report.txt",
    ]
    if job.settings.save_calibration:
        names.append(f"{job.name}.calibration.json")
    return [out_dir / n for n in names]


def _guard_job_outputs(job: Job, load: Path | None) -> None:
    """Before any work: no output of the job may be an input (the model, its external data, the
    calibration data or result), a device or FIFO, or (without --overwrite) an existing model."""
    settings = job.settings
    inputs: list[Any] = [settings.calib, load]
    for path in _job_outputs(job):
        if path.name.endswith(".onnx.data"):
            continue  # checked as the model's data file just below
        model_io.check_output_path(
            path,
            job.model,
            False,
            inputs=inputs,
            external_data=path.suffix == ".onnx",
            what=f"output {path.name}",
        )


def _quantize_one(job: Job, outcome: Outcome) -> None:
    from quark_onnx.errors import ModelLoadError

    settings = job.settings
    model_path = Path(job.model)
    if not model_path.is_file():
        raise ModelLoadError(f"{job.model}: no such model file")
    final = job.output
    if final.exists() and not settings.overwrite:
        raise ModelSaveError(
            f"{final} exists; pass --overwrite to replace it, or choose another output folder"
        )
    load = None
    if settings.load_calibration is not None:
        load = Path(settings.load_calibration)
        if load.is_dir():
            load = load / f"{job.name}.calibration.json"
    _guard_job_outputs(job, load)
    # Every file is written into a private folder beside the outputs and moved into place only
    # when the whole job succeeded: a job that fails (or is interrupted) leaves nothing behind.
    staging = Path(tempfile.mkdtemp(prefix=f".{job.name}.", suffix=".partial", dir=job.out_dir))
    try:
        _quantize_into(job, outcome, staging, load, reader_limit=settings.calib_limit)
        for path in _job_outputs(job):
            staged = staging / path.name
            if staged.exists():
                os.replace(staged, path)
    except OSError as exc:
        raise ModelSaveError(
            f"{job.out_dir}: cannot write the outputs of {job.name} ({exc.strerror or exc}); "
            "check free space and permissions"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    outcome.output = str(final)


def _quantize_into(
    job: Job, outcome: Outcome, out_dir: Path, load: Path | None, reader_limit: int | None
) -> None:
    """Quantize ``job`` writing every output into ``out_dir`` (the job's staging folder)."""
    from quark_onnx.config import Config
    from quark_onnx.model_io import atomic_write_bytes
    from quark_onnx.quantizer import ModelQuantizer

    settings = job.settings
    model_path = Path(job.model)
    output = out_dir / job.output.name
    qconfig = settings.build_config()
    fixed_shapes = apply_calibration_shapes(settings, qconfig, model_path, job.name)
    quantizer = ModelQuantizer(
        Config(global_quant_config=qconfig),
        calibration_shards=settings.calib_shards,
        shard_backend=settings.shard_backend,
    )
    if settings.load_calibration is None:  # calibration reads the samples the comparison needs
        quantizer.keep_samples = _compare_count(settings)
    reader = calibration_reader(settings, model_path, reader_limit)
    save = out_dir / f"{job.name}.calibration.json" if settings.save_calibration else None
    quantizer.quantize_model(
        model_path,
        output,
        reader,
        calibration_result=load,
        save_calibration=save,
        require_ready=settings.require_ready,
    )
    report = quantizer.report
    if report is None:  # pragma: no cover - quantize_model always sets it
        raise QuarkOnnxError(f"{job.model}: the quantizer returned no report")
    report.output = str(job.output)
    _exclude_warnings(job, report)
    if fixed_shapes:
        report.notes.append(fixed_shapes)
    outcome.quantized_nodes = (report.plan or {}).get("quantized_nodes")
    outcome.ready = report.ready
    outcome.faithful = report.faithful

    report_json = out_dir / f"{job.name}.report.json"
    report.save(report_json)  # now, so that a failing comparison leaves the report

    comparison = None
    feeds: Any = None
    if _compare_count(settings) > 0 and quantizer.kept_samples:
        feeds = iter(quantizer.kept_samples)  # the calibration's first samples, not read again
    else:
        feeds = comparison_feeds(settings, qconfig, model_path)
    if feeds is not None:
        from quark_onnx import memory
        from quark_onnx.compare import compare_models

        feeds = _budgeted(settings, feeds)

        start = time.perf_counter()
        try:
            comparison = compare_models(model_path, output, feeds, layers=settings.compare_layers)
        except QuarkOnnxError as exc:
            logger.warning("%s: float vs quantized comparison failed: %s", job.name, exc)
        # the comparison is a stage of the run: its time and the high-water mark after it
        report.timings["compare"] = round(time.perf_counter() - start, 4)
        peak = memory.peak_rss_mb()
        if peak is not None:
            report.peak_rss_mb["compare"] = peak
        report.save(report_json)
    if comparison is not None:
        compare_json = out_dir / f"{job.name}.compare.json"
        text = json.dumps(comparison.to_dict(), indent=1)
        atomic_write_bytes(compare_json, text.encode("utf-8"))
        outcome.compared_samples = comparison.samples
        if comparison.outputs:
            first = comparison.outputs[0]
            outcome.output_sqnr_db = first.sqnr_db
            outcome.output_cosine = first.cosine
            outcome.agreement = first.agreement
            outcome.agreement_kind = first.agreement_kind

    lines = [report.summary()]
    if comparison is not None:
        lines += ["", "float vs quantized on the first calibration samples:", comparison.summary()]
    report_txt = out_dir / f"{job.name}.report.txt"
    atomic_write_bytes(report_txt, ("\n".join(lines) + "\n").encode("utf-8"))


class _LogStream:
    """A stream that is not a terminal: progress in a worker is written as log lines, so bars of
    several processes never fight over one terminal line."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return False


def _worker(job: Job) -> Outcome:
    """Entry point of a ``--jobs`` worker process (spawned: set up logging afresh)."""
    sys.stderr = _LogStream(sys.stderr)  # type: ignore[assignment]
    logging.basicConfig(
        level=job.settings.log_level,
        format=f"%(levelname)s: {job.name}: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # SIGTERM (sent by the main process when the batch is interrupted) unwinds the job, so its
    # staging folder is removed; outside a job the default action just ends the worker.
    with model_io.sigterm_as_interrupt():
        return quantize_one(job)


def _worker_init() -> None:
    """Workers ignore Ctrl-C (the terminal sends it to the whole process group): the main process
    decides, and stops running jobs with SIGTERM."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


# ------------------------------------------------------------------------------------------------
# The batch
# ------------------------------------------------------------------------------------------------


def collect_models(paths: Sequence[str]) -> list[Path]:
    """Expand folders to the ``*.onnx`` files directly inside them (sorted); keep files as
    given (a missing file is kept: it fails on its own, not the whole batch).

    Raises:
        ConfigError: a folder holds no ``.onnx`` file.
    """
    models: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix.lower() == ".onnx" and q.is_file())
            if not found:
                raise ConfigError(f"{p}: folder holds no .onnx model")
            models.extend(found)
        else:
            models.append(p)
    return models


def output_names(models: Sequence[Path]) -> list[str]:
    """The output name (file stem) of each model.

    Raises:
        ConfigError: two models would write the same output.
    """
    names = [m.stem if m.suffix.lower() == ".onnx" else m.name for m in models]
    seen: dict[str, Path] = {}
    for model, name in zip(models, names, strict=True):
        if name in seen:
            raise ConfigError(
                f"{seen[name]} and {model} would both be written as {name}.onnx; quantize them "
                "into different output folders"
            )
        seen[name] = model
    return names


class _Console:
    """Status lines on stderr, with the overall progress bar on a terminal."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        from quark_onnx.progress import Progress

        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = total
        self.bar = Progress(
            total,
            desc="models",
            unit="models",
            enabled=self.tty,
            stream=self.stream,
            logger=logger,
            refresh_interval=0.0,
        )

    def line(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()

    def started(self, job: Job) -> None:
        self.line(f"[{job.index + 1}/{self.total}] {job.name}: quantizing {job.model}")

    def finished(self, outcome: Outcome, debug: bool) -> None:
        if outcome.ok:
            self.line(
                f"[{outcome.index + 1}/{self.total}] {outcome.name}: done in "
                f"{outcome.seconds:.1f} s"
            )
        else:
            self.line(f"error: {outcome.model}: {outcome.message}")
            if debug and outcome.traceback:
                self.stream.write(outcome.traceback)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _fmt_optional(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


#: How the summary table names each kind of agreement (see quark_onnx.compare).
_AGREEMENT_LABELS = {"top1": "top-1", "argmax": "pixels"}


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """The end-of-run table: model, status, seconds, quantized ops, readiness, fidelity.

    ``faithful`` is the fidelity guard's verdict on every output against the original float
    model (:mod:`quark_onnx.fidelity`); a model can be ready and not faithful.

    Fidelity is of the first graph output, quantized vs float on the first calibration samples:
    SQNR and cosine always; ``agreement`` is the top-1 agreement of a score vector output
    (``top-1``) or the per-pixel agreement of the argmax over the channel axis of a dense output
    (``pixels``, segmentation maps), and ``-`` for other outputs (boxes, embeddings).
    """
    header = (
        "model",
        "status",
        "seconds",
        "ops quantized",
        "Vitis AI ready",
        "faithful",
        "output SQNR dB",
        "cosine",
        "agreement",
    )
    rows = [header]
    for o in outcomes:
        ready = "-" if o.ready is None else ("yes" if o.ready else "no")
        faithful = "-" if o.faithful is None else ("yes" if o.faithful else "NO")
        agree = "-"
        if o.agreement is not None:
            label = _AGREEMENT_LABELS.get(o.agreement_kind or "", o.agreement_kind or "")
            agree = f"{label} {o.agreement:.3f} ({o.compared_samples})"
        rows.append(
            (
                o.name,
                "ok"
                if o.ok
                else ("interrupted" if o.message.startswith("interrupted") else "failed"),
                f"{o.seconds:.1f}",
                _fmt_optional(o.quantized_nodes, "d"),
                ready,
                faithful,
                _fmt_optional(o.output_sqnr_db, ".1f"),
                _fmt_optional(o.output_cosine, ".4f"),
                agree,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {2, 3, 6, 7}
    lines = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    failed = sum(not o.ok for o in outcomes)
    lines.append("")
    lines.append(
        f"{len(outcomes) - failed} of {len(outcomes)} model(s) quantized"
        + (f", {failed} failed" if failed else "")
    )
    if any(o.output_sqnr_db is not None for o in outcomes):
        lines.append(
            "output SQNR, cosine, agreement: the first output, quantized vs float model on the "
            "first calibration samples (count in brackets)"
        )
        lines.append(
            "agreement: top-1 = same argmax of a score vector; pixels = same argmax over the "
            "channels per position of a dense output; - = neither fits (boxes, embeddings)"
        )
    if any(o.ok and o.faithful is False for o in outcomes):
        lines.append(
            "faithful NO: the quantized outputs do not follow the float model's; "
            "OUT_DIR/MODEL.report.txt names the outputs and the layers that lose the most "
            "(exit code 0 unless --require-fidelity)"
        )
    if any(o.ok and o.ready is False for o in outcomes):
        lines.append(
            "Vitis AI ready no: see OUT_DIR/MODEL.report.txt for why (exit code 0 unless "
            "--require-ready)"
        )
    return "\n".join(lines)


class BatchInterrupted(KeyboardInterrupt):
    """The batch was stopped by Ctrl-C or SIGTERM; :attr:`outcomes` holds every job's outcome
    (those not finished are failed with "interrupted")."""

    def __init__(self, outcomes: list[Outcome], signal_name: str) -> None:
        super().__init__(signal_name)
        self.outcomes = outcomes
        self.signal_name = signal_name


#: Seconds a running worker gets to unwind after SIGTERM before it is killed.
_STOP_GRACE = 5.0


def failed_outcome(job: Job, message: str, tb: str = "") -> Outcome:
    """The outcome of a job that did not run to the end (nothing of it is written)."""
    return Outcome(
        index=job.index,
        model=job.model,
        name=job.name,
        ok=False,
        seconds=0.0,
        message=message,
        traceback=tb,
    )


def _interrupted(job: Job) -> Outcome:
    return failed_outcome(job, "interrupted: not quantized, nothing written")


def _remove_staging(jobs: Sequence[Job]) -> None:
    """Remove the staging folders of jobs whose worker had to be killed."""
    for job in jobs:
        for leftover in Path(job.out_dir).glob(f".{job.name}.*.partial"):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)


def _stop_pool(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Cancel the queued jobs and stop the running ones now (SIGTERM, then SIGKILL after
    :data:`_STOP_GRACE` s); every worker is joined, so no process is left behind."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _stop_resource_tracker() -> None:
    """Stop and reap multiprocessing's resource tracker (started for the pool's semaphores).

    Left running it outlives this process, and where the process that adopts orphans does not
    reap them (a container's init) it stays behind as a defunct process. Called once the pool is
    garbage: its semaphores are unregistered first, so the tracker has nothing left to clean.
    Python < 3.11 has no ``_stop``: nothing is done there.
    """
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


def run_batch(jobs: Sequence[Job], workers: int, console: _Console, debug: bool) -> list[Outcome]:
    """Quantize every job (in ``workers`` spawned processes when > 1); outcomes in job order.

    Raises:
        BatchInterrupted: on Ctrl-C or SIGTERM: queued jobs are not started, running ones are
            stopped at once (their files removed), and the outcomes so far are attached.
    """
    done: dict[int, Outcome] = {}
    try:
        if workers <= 1 or len(jobs) <= 1:
            for job in jobs:
                console.started(job)
                outcome = quantize_one(job)
                console.finished(outcome, debug)
                done[job.index] = outcome
        else:
            context = multiprocessing.get_context("spawn")
            pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=min(workers, len(jobs)), mp_context=context, initializer=_worker_init
            )
            try:
                console.line(
                    f"quantizing {len(jobs)} models in {min(workers, len(jobs))} processes"
                )
                futures = {pool.submit(_worker, job): job for job in jobs}
                for future in concurrent.futures.as_completed(futures):
                    job = futures[future]
                    try:
                        outcome = future.result()
                    except Exception as exc:  # the worker process died (out of memory, ...)
                        outcome = Outcome(
                            index=job.index,
                            model=job.model,
                            name=job.name,
                            ok=False,
                            seconds=0.0,
                            message="the worker process failed: "
                            + (_one_line(str(exc)) or type(exc).__name__),
                            traceback=traceback.format_exc(),
                        )
                    console.finished(outcome, debug)
                    done[job.index] = outcome
            except BaseException:
                _stop_pool(pool)
                _remove_staging([j for j in jobs if j.index not in done])
                raise
            finally:
                pool.shutdown(wait=True)
    except KeyboardInterrupt as exc:
        console.close()
        name = "SIGTERM" if isinstance(exc, model_io.Terminated) else "SIGINT"
        outcomes = [done.get(job.index) or _interrupted(job) for job in jobs]
        raise BatchInterrupted(outcomes, name) from None
    console.close()
    return [done[job.index] for job in jobs]


# ------------------------------------------------------------------------------------------------
# Subcommands
# ------------------------------------------------------------------------------------------------


def _log_level(args: argparse.Namespace) -> int:
    if getattr(args, "quiet", False):
        return logging.ERROR
    if getattr(args, "verbose", False):
        return logging.INFO
    return logging.WARNING


def _cmd_quantize(args: argparse.Namespace) -> int:
    calib = args.calib
    if calib is not None:
        p = Path(calib)
        if not p.exists():
            raise ConfigError(f"--calib {calib}: no such file or folder")
        if p.is_file() and p.suffix.lower() not in _NPZ_SUFFIXES:
            raise ConfigError(f"--calib {calib}: expected a .npz/.npy file or a folder of images")
        if p.is_file() and args.preprocess is not None:
            raise ConfigError("--preprocess applies to an image folder given with --calib DIR")
        if p.is_dir() and args.preprocess is None:
            from quark_onnx.images import PreprocessSpec

            logger.warning(
                "--calib %s is an image folder and no --preprocess is given: using %s",
                calib,
                PreprocessSpec().to_string(),
            )
    elif args.preprocess is not None:
        raise ConfigError("--preprocess needs --calib DIR (a folder of images)")
    if args.random_calib is not None and args.random_calib < 1:
        raise ConfigError(f"--random-calib {args.random_calib}: expected a positive number")
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: expected a positive number")
    if args.calib_limit is not None and args.calib_limit < 1:
        raise ConfigError(f"--calib-limit {args.calib_limit}: expected a positive number")
    if args.compare_samples is not None and args.compare_samples < 0:
        raise ConfigError(
            f"--compare-samples {args.compare_samples}: expected 0 (no comparison) or more"
        )
    if args.calib_shards < 1:
        raise ConfigError(f"--calib-shards {args.calib_shards}: expected a positive number")
    if args.ray is not None:
        from quark_onnx.ray_runner import import_ray

        if args.jobs > 1:
            raise ConfigError("--ray runs every model as a Ray task: leave out --jobs")
        import_ray()  # not installed: say how to install it, before any model
    exclude = tuple(n for item in args.exclude or () for n in item.split(",") if n)
    settings = QuantizeSettings(
        preset=args.config,
        assignments=tuple(parse_assignments(args.set or ())),
        exclude=exclude,
        random_samples=args.random_calib,
        calib=str(Path(calib).resolve()) if calib is not None else None,
        preprocess=args.preprocess,
        calib_limit=args.calib_limit,
        compare_samples=args.compare_samples,
        compare_layers=args.compare_layers,
        fix_shapes_from_calib=args.fix_shapes_from_calib,
        save_calibration=args.save_calibration,
        load_calibration=args.load_calibration,
        overwrite=args.overwrite,
        log_level=_log_level(args),
        require_fidelity=args.require_fidelity,
        require_ready=args.require_ready,
        calib_shards=args.calib_shards,
        shard_backend="ray" if args.ray is not None else "processes",
    )
    settings.preprocess_spec()  # a bad spec is a usage error, before any model
    qconfig = settings.build_config()  # so is an unknown preset or option
    options = qconfig.resolved_options()
    if (
        calib is None
        and not options.UseRandomData
        and args.load_calibration is None
        and qconfig.needs_calibration_data()
    ):
        raise ConfigError(
            "no calibration data: give --calib FILE.npz|DIR, --random-calib N or "
            "--load-calibration PATH"
        )
    models = collect_models(args.models)
    names = output_names(models)
    load = args.load_calibration
    if load is not None and len(models) > 1 and not Path(load).is_dir():
        raise ConfigError(
            "--load-calibration with several models expects a folder holding "
            "NAME.calibration.json files (as written by --save-calibration)"
        )
    out_dir = model_io.check_path_text(args.output, "-o", ConfigError)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"-o {out_dir}: exists and is not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSaveError(
            f"-o {out_dir}: cannot create the output folder ({exc.strerror or exc}); choose a "
            "writable folder"
        ) from exc
    jobs = [
        Job(index=i, model=str(m), name=n, out_dir=str(out_dir.resolve()), settings=settings)
        for i, (m, n) in enumerate(zip(models, names, strict=True))
    ]
    console = _Console(len(jobs))
    stopped_by = None
    if args.ray is not None:
        from quark_onnx.ray_runner import run_batch_ray

        # Ray's own wait turns Ctrl-C / SIGTERM into KeyboardInterrupt / Terminated
        outcomes = run_batch_ray(
            jobs, console, args.debug, address=args.ray or None, task_cpus=args.ray_cpus
        )
    else:
        try:
            outcomes = run_batch(jobs, args.jobs, console, args.debug)
        except BatchInterrupted as stop:
            outcomes, stopped_by = stop.outcomes, stop.signal_name
    # (outside the handler: the pool, referenced by the interrupted frames, is gone by now)
    gc.collect()
    _stop_resource_tracker()
    print(summary_table(outcomes))
    if stopped_by is not None:
        finished = sum(o.ok for o in outcomes)
        print(
            f"stopped by {stopped_by}: {finished} model(s) finished and written, "
            f"{len(outcomes) - finished} not (nothing of them was left)",
            file=sys.stderr,
        )
        raise model_io.Terminated(stopped_by) if stopped_by == "SIGTERM" else KeyboardInterrupt
    if args.require_ready and any(o.ok and o.ready is False for o in outcomes):
        return EXIT_FAILED
    return EXIT_FAILED if any(not o.ok for o in outcomes) else EXIT_OK


def _cmd_check(args: argparse.Namespace) -> int:
    from quark_onnx.check import check

    status = EXIT_OK
    results = []
    models = [str(m) for m in collect_models(args.models)]
    for model in models:
        try:
            result = check(model)
        except QuarkOnnxError as exc:
            print(f"error: {model}: {error_message(model, exc)}", file=sys.stderr)
            if args.debug:
                traceback.print_exc()
            status = EXIT_FAILED
            results.append({"model": model, "error": error_message(model, exc)})
            continue
        if not result.ready or (args.strict and result.warnings):
            status = EXIT_FAILED
        if args.json:
            results.append(result.to_dict())
        else:
            print(f"{model}: {result.summary()}")
    if args.json:
        print(json.dumps(results if len(models) > 1 else results[0], indent=1))
    return status


def _cmd_compare(args: argparse.Namespace) -> int:
    from quark_onnx.compare import compare_models

    if (args.data is None) == (args.random is None):
        raise ConfigError("compare needs data: give either --data FILE.npz|DIR or --random N")
    if args.preprocess is not None and (args.data is None or not Path(args.data).is_dir()):
        raise ConfigError("--preprocess applies to an image folder given with --data DIR")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: expected a positive number")
    if args.json is not None:  # before any work: never over an input
        model_io.check_output_path(
            args.json,
            args.float_model,
            inputs=[args.quant_model, args.data],
            external_data=False,
            what="--json report",
        )
    if args.random is not None:
        import onnx

        from quark_onnx.calibration import RandomDataReader

        if args.random < 1:
            raise ConfigError(f"--random {args.random}: expected a positive number")
        reader: Any = RandomDataReader(
            onnx.load(args.float_model, load_external_data=False),
            num_samples=min(args.random, args.limit or args.random),
            seed=args.seed,
        )
    else:
        data = Path(args.data)
        if not data.exists():
            raise ConfigError(f"--data {data}: no such file or folder")
        settings = QuantizeSettings(calib=str(data), preprocess=args.preprocess)
        settings.preprocess_spec()
        reader = calibration_reader(settings, args.float_model, args.limit)
    result = compare_models(
        args.float_model, args.quant_model, iter(reader.get_next, None), layers=not args.no_layers
    )
    print(result.summary(worst=args.worst))
    if args.json is not None:
        from quark_onnx.model_io import atomic_write_bytes

        atomic_write_bytes(args.json, json.dumps(result.to_dict(), indent=1).encode("utf-8"))
    return EXIT_OK


def _settings_from_report(path: str | os.PathLike) -> Any:
    """The QuantizationConfig recorded in a ``quantize`` report (``MODEL.report.json``)."""
    from quark_onnx.recipe import config_from_json

    text = model_io.read_regular_file(
        path, limit=64 << 20, what="JSON report", error=ConfigError, option="--report"
    )
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"--report {path}: not a readable JSON report ({exc})") from exc
    settings = data.get("settings") if isinstance(data, dict) else None
    if not isinstance(settings, dict) or not isinstance(settings.get("extra_options"), dict):
        raise ConfigError(
            f"--report {path}: holds no 'settings' (give the MODEL.report.json that "
            "`quark-onnx quantize` wrote beside the model)"
        )
    settings = dict(settings)
    extra = settings.pop("extra_options")
    return config_from_json({"settings": settings, "extra_options": extra}, f"--report {path}")


def _require_file(path: str, flag: str) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"{flag} {path}: no such file")


def _cmd_export(args: argparse.Namespace) -> int:
    _require_file(args.model, "MODEL")
    if args.format == "recipe":
        from quark_onnx.recipe import save_recipe

        if args.float_model is None:
            raise ConfigError(
                "--format recipe needs --float-model FLOAT.onnx (the model MODEL was quantized "
                "from: the recipe records its identity and rebuilds from it)"
            )
        _require_file(args.float_model, "--float-model")
        if args.report is not None and (args.set or args.config is not None):
            raise ConfigError("give either --report or --config/--set, not both")
        preset = None
        if args.report is not None:
            qconfig = _settings_from_report(args.report)
        else:
            preset = args.config or _DEFAULT_PRESET
            qconfig = QuantizeSettings(
                preset=preset, assignments=tuple(parse_assignments(args.set or ()))
            ).build_config()
            if args.set:
                preset = None  # the recorded config is no longer the preset's
        path = save_recipe(
            args.output,
            args.model,
            qconfig,
            args.float_model,
            preset=preset,
            overwrite=args.overwrite,
        )
        print(
            f"{args.model}: recipe written to {path.parent} (verified: it rebuilds the model "
            "byte for byte)"
        )
        return EXIT_OK
    if args.report is not None or args.set or args.config is not None:
        raise ConfigError(f"--report/--config/--set apply to --format recipe, not {args.format}")
    if args.format == "gguf":
        try:
            from quark_onnx.gguf_export import export_gguf
        except ImportError as exc:  # pragma: no cover - the module ships with the package
            raise ModelSaveError(
                f"GGUF export is not available ({exc}); pip install 'quark_onnx[gguf]'"
            ) from exc
        _check_not_input(args.output, args.model, args.overwrite)
        summary = export_gguf(args.model, args.output, require_exact=args.require_exact)
        counts = ", ".join(f"{n} {t}" for t, n in sorted(summary.get("counts", {}).items()))
        print(
            f"{args.model}: wrote {summary.get('path', args.output)}: "
            f"{summary.get('quantized', 0)} quantized tensor(s); {counts or 'no tensor'}"
        )
        skipped = summary.get("skipped", [])
        if skipped and args.verbose:
            for item in skipped:
                print(f"  skipped {item.get('name')}: {item.get('reason')}")
        elif skipped:
            print(f"  {len(skipped)} initializer(s) not written (-v lists them with the reason)")
        return EXIT_OK
    # onnx: the QDQ model itself, validated and written atomically
    _check_not_input(args.output, args.model, args.overwrite)
    proto = model_io.load_model(args.model, upgrade_opset=False)
    model_io.save_model(
        proto,
        args.output,
        input_path=args.model,
        external_data=True if args.external_data else None,
    )
    print(f"{args.model}: written to {args.output}")
    return EXIT_OK


def _check_not_input(output: str, model: str, overwrite: bool) -> None:
    model_io.check_output_path(output, Path(model), False)
    if Path(output).exists() and not overwrite:
        raise ModelSaveError(f"{output} exists; pass --overwrite to replace it")


def _cmd_import(args: argparse.Namespace) -> int:
    from quark_onnx.recipe import RECIPE_FILE, import_recipe, load_recipe

    source = Path(args.source)
    if source.is_dir():
        if not (source / RECIPE_FILE).is_file():
            raise ConfigError(f"{source}: a folder without {RECIPE_FILE}; not a recipe folder")
        if args.float_model is not None:
            _require_file(args.float_model, "--float-model")
        out = Path(args.output)
        if out.exists() and not args.overwrite:
            raise ModelSaveError(f"{out} exists; pass --overwrite to replace it")
        load_recipe(source, args.float_model, out, overwrite=False)
        print(f"{source}: quantized model rebuilt to {out} (no calibration)")
        return EXIT_OK
    if not source.is_file():
        raise ConfigError(f"{source}: no such QDQ model file or recipe folder")
    if args.float_model is not None:
        raise ConfigError(
            "--float-model applies to rebuilding from a recipe folder; importing a QDQ model "
            "writes its float model into the recipe"
        )
    path = import_recipe(source, args.output, overwrite=args.overwrite)
    from quark_onnx.recipe import read_recipe

    recipe = read_recipe(path.parent)
    print(
        f"{source}: {len(recipe.params)} quantized tensor(s) imported into {path.parent} "
        "(recipe.json, params.safetensors, float_model.onnx)"
    )
    return EXIT_OK


def _cmd_presets(args: argparse.Namespace) -> int:
    from quark_onnx.config import get_default_config
    from quark_onnx.presets import preset_names, read_preset

    # the default preset first, then the others in name order
    names = args.names or sorted(preset_names(), key=lambda n: (n != _DEFAULT_PRESET, n))
    data = {}
    for name in names:
        preset = read_preset(name)
        if args.all:
            settings = get_default_config(name).effective_settings()
        else:
            settings = {**preset.config, "extra_options": dict(preset.extra_options)}
        data[preset.name] = {"description": preset.description, "settings": settings}
    if args.json:
        print(json.dumps(data, indent=1, default=str))
        return EXIT_OK
    for name, entry in data.items():
        print(f"{name}: {entry['description']}")
        settings = dict(entry["settings"])
        extra = settings.pop("extra_options", {})
        for key, value in settings.items():
            print(f"  {key} = {value!r}" if not isinstance(value, str) else f"  {key} = {value}")
        if extra:
            print("  extra_options:")
            for key, value in extra.items():
                print(f"    {key} = {value!r}")
    if not args.all:
        print("\n(settings the preset file sets; `quark-onnx presets --all` shows every setting)")
    return EXIT_OK


def _cmd_options(args: argparse.Namespace) -> int:
    import typing

    from quark_onnx.options import ExtraOptions, closest_name, option_fields

    types = typing.get_type_hints(ExtraOptions)
    fields = option_fields()
    known = [f.name for f in fields]
    wanted = args.names or known
    for name in wanted:
        if name not in known:
            close = closest_name(name, known)
            hint = f"; did you mean {close!r}?" if close else ""
            raise ConfigError(f"unknown extra option {name!r}{hint}")
    for f in fields:
        if f.name not in wanted:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        print(f"{f.name} ({types[f.name].__name__}, default {default!r})")
        print(f"    {f.metadata.get('doc', '')}")
    if not args.names:
        print(
            "\nQuantizationConfig fields (also accepted by --set): "
            + ", ".join(_config_field_names())
        )
    return EXIT_OK


# ------------------------------------------------------------------------------------------------
# The parser
# ------------------------------------------------------------------------------------------------


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("messages")
    group.add_argument(
        "--debug",
        action="store_true",
        help="print the full traceback of every error (default: one line per error)",
    )
    group.add_argument(
        "-v", "--verbose", action="store_true", help="also print informational log messages"
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", help="print errors only, no warnings (wins over -v)"
    )
    return common


def _wrap(text: str) -> str:
    """A help description wrapped to the terminal (the formatter keeps text as written)."""
    import shutil
    import textwrap

    width = min(100, max(40, shutil.get_terminal_size((100, 24)).columns - 2))
    return textwrap.fill(" ".join(text.split()), width)


def _preset_names() -> list[str]:
    """The presets in ``configs/`` (every file there is accepted by ``--config``)."""
    from quark_onnx.presets import preset_names

    try:
        return preset_names()
    except (OSError, ModuleNotFoundError):  # pragma: no cover - a broken installation
        return [_DEFAULT_PRESET]


def _add_models(parser: argparse.ArgumentParser, done: str) -> None:
    """The ``MODEL_OR_FOLDER...`` positional of the commands that take many models."""
    parser.add_argument(
        "models",
        nargs="+",
        metavar="MODEL_OR_FOLDER",
        help=f"ONNX model files, or folders whose *.onnx files are all {done}",
    )


def _add_output(parser: argparse.ArgumentParser, metavar: str, help: str) -> None:
    """The required ``-o/--output``."""
    parser.add_argument("-o", "--output", required=True, metavar=metavar, help=help)


def _add_settings(
    parser: argparse.ArgumentParser, *, default: str | None, preset_help: str, set_help: str
) -> None:
    """``--config/--preset PRESET`` and the repeatable ``--set KEY=VALUE``."""
    parser.add_argument(
        "--config", "--preset", dest="config", default=default, metavar="PRESET", help=preset_help
    )
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help=set_help)


def _add_float_model(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--float-model", metavar="FLOAT", help=help)


def build_parser() -> argparse.ArgumentParser:
    """The ``quark-onnx`` argument parser (every flag documented in its ``--help``)."""
    from quark_onnx import __version__

    parser = argparse.ArgumentParser(
        prog="quark-onnx",
        description=_wrap(
            "Post-training quantization of ONNX models for AMD Vitis AI / Ryzen AI NPUs "
            "(power-of-two XINT8 QDQ models)."
        ),
        epilog="Run `quark-onnx COMMAND --help` for the flags of a command.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"quark-onnx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    common = _common()

    q = sub.add_parser(
        "quantize",
        parents=[common],
        formatter_class=_Formatter,
        help="quantize one or many models",
        description=_wrap(
            "Quantize ONNX models. For each MODEL.onnx write OUT_DIR/MODEL.onnx, "
            "OUT_DIR/MODEL.report.json, OUT_DIR/MODEL.report.txt and (when there is data) "
            "OUT_DIR/MODEL.compare.json. A failing model prints one `error:` line and the others "
            "go on; the exit code is 1 when any model failed, or with --require-ready when a "
            "model is not Vitis AI-ready (without it a not-ready model is written, reported and "
            "the exit code is 0)."
        ),
        epilog="examples:\n"
        "  quark-onnx quantize model.onnx -o out --calib calib.npz\n"
        "  quark-onnx quantize models/ -o out --random-calib 16 --jobs 2\n"
        "  quark-onnx quantize models/ -o out --calib calib.npz --ray auto --calib-shards 4\n"
        "  quark-onnx quantize squeezenet.onnx -o out --calib images/ \\\n"
        "      --preprocess 'resize=256,crop=224,mean=104;117;123,order=BGR'\n"
        "  quark-onnx quantize model.onnx -o out --calib calib.npz --set include_cle=true \\\n"
        "      --set ActivationSymmetric=true --exclude /head/Gemm",
    )
    _add_models(q, "quantized")
    _add_output(q, "OUT_DIR", "folder for the quantized models and reports (created if missing)")
    _add_settings(
        q,
        default=_DEFAULT_PRESET,
        preset_help=f"the preset to start from (default {_DEFAULT_PRESET}; one of "
        f"{', '.join(_preset_names())}; see `quark-onnx presets`)",
        set_help="override a QuantizationConfig field (include_cle=true, calibrate_method="
        "NonOverflow) or an extra option (ActivationSymmetric=false); VALUE is a JSON literal, "
        "else a string; repeat for several (see `quark-onnx options`)",
    )
    data = q.add_argument_group(
        "calibration data (one of --calib, --random-calib, --load-calibration)"
    )
    source = data.add_mutually_exclusive_group()
    source.add_argument(
        "--calib",
        metavar="FILE_OR_DIR",
        help="a .npz/.npy file of input samples (axis 0; one array per input, named like the "
        "input, for multi-input models) or a folder of JPEG/PNG images (with --preprocess)",
    )
    source.add_argument(
        "--random-calib",
        type=int,
        metavar="N",
        help="calibrate on N reproducible random samples shaped like the model input "
        "(UseRandomData=true, RandomDataSamples=N); for testing, not for accuracy",
    )
    data.add_argument(
        "--preprocess",
        metavar="SPEC",
        help="pre-processing of the images of --calib DIR, key=value items: resize=N (short "
        "side) or resize=short|long|fit|stretch|height with size=HxW (height first) or size=N; "
        "letterbox (= resize=fit), pad=V (value of padded elements after normalisation), "
        "align=center|topleft, crop=N or HxW, multiple=M, grayscale, scale, mean, std, "
        "order=RGB|BGR, layout=NCHW|NHWC. E.g. classifier 'resize=256,crop=224,scale=1/255,"
        "mean=0.485;0.456;0.406,std=0.229;0.224;0.225'; YOLOX 'letterbox,size=640,pad=114,"
        "order=BGR'; OCR 'resize=height,size=48x192,scale=1/255,mean=0.5,std=0.5,order=BGR'. "
        "Checked against the model input shape; a mismatch error proposes specs that fit",
    )
    data.add_argument(
        "--calib-limit",
        type=int,
        metavar="N",
        help="use only the first N calibration samples (sets CalibDataSize)",
    )
    data.add_argument(
        "--save-calibration",
        action="store_true",
        help="also write OUT_DIR/MODEL.calibration.json (the calibration statistics) so that "
        "re-quantizing with other options can skip calibration",
    )
    data.add_argument(
        "--load-calibration",
        metavar="PATH",
        help="use calibration statistics saved by --save-calibration instead of running the "
        "model: a file (one model) or a folder holding MODEL.calibration.json",
    )
    data.add_argument(
        "--calib-shards",
        type=int,
        default=1,
        metavar="K",
        help="calibrate K contiguous parts of the data in parallel (K processes, or K Ray tasks "
        "with --ray) and merge their statistics; the output is byte-identical (default 1)",
    )
    q.add_argument(
        "--exclude",
        action="extend",
        nargs="+",
        metavar="NODE",
        help="keep these nodes in float (nodes_to_exclude); names may also be comma-separated; "
        "put the flag after the models, the node list ends at the next flag",
    )
    q.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="quantize N models at once in separate processes (default 1); the outputs do not "
        "depend on N",
    )
    q.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="quantize every model as a Ray task (needs: pip install 'quark_onnx[ray]'): on the "
        "cluster at ADDRESS (host:6379 from `ray start --head`, `auto`, or ray://HOST:10001), "
        "else RAY_ADDRESS, else a local cluster started for this run; the outputs are those of "
        "--jobs; models, data and OUT_DIR must be on paths every node sees",
    )
    q.add_argument(
        "--ray-cpus",
        type=float,
        default=1.0,
        metavar="N",
        help="CPUs Ray reserves for each model's task (default 1)",
    )
    q.add_argument(
        "--compare-samples",
        type=int,
        default=None,
        metavar="N",
        help="compare the quantized model with the float model on the first N calibration "
        f"samples (default {_DEFAULT_COMPARE_SAMPLES}, fewer for inputs above "
        f"{_COMPARE_BUDGET // _DEFAULT_COMPARE_SAMPLES} values: at most {_COMPARE_BUDGET} "
        "input values in all; 0: do not compare): SQNR and cosine of every output, top-1 "
        "(score vectors) or per-pixel argmax (dense outputs) agreement",
    )
    q.add_argument(
        "--compare-layers",
        action="store_true",
        help="also compare every quantized activation (per-layer SQNR in MODEL.compare.json; "
        "runs both models with all intermediate tensors as outputs: slower, more memory)",
    )
    q.add_argument(
        "--fix-shapes-from-calib",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write a dynamic-shape model with the one static shape of its calibration data "
        "(sets FixShapes, stated in the report); default: on for NPU presets (XINT8), off for "
        "the others (which then log the FixShapes value that would do it)",
    )
    q.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing outputs in OUT_DIR (default: a model whose output exists fails)",
    )
    q.add_argument(
        "--require-ready",
        action="store_true",
        help="exit with code 1 also when a quantized model is not Vitis AI-ready (without it "
        "a not-ready model is written, reported and exits 0)",
    )
    q.add_argument(
        "--require-fidelity",
        action="store_true",
        help="fail a model (no output written, exit code 1) whose outputs do not follow the "
        "float model's (extra option RequireFidelity; thresholds FidelityMinSQNR, "
        "FidelityMinAgreement)",
    )
    q.set_defaults(func=_cmd_quantize)

    c = sub.add_parser(
        "check",
        parents=[common],
        formatter_class=_Formatter,
        help="is a model ready for the Vitis AI NPU (XINT8)? if not, why",
        description=_wrap(
            "Check ONNX models for the Vitis AI / Ryzen AI NPU (XINT8): power-of-two "
            "Q/DQ scales, the NPU shift rules, supported ops, static shapes. Prints every reason a "
            "model is not ready; the exit code is 1 when any model is not ready."
        ),
    )
    _add_models(c, "checked")
    c.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")
    c.add_argument(
        "--strict",
        action="store_true",
        help="also fail (exit 1) on warnings (ops that run on the CPU between NPU parts)",
    )
    c.set_defaults(func=_cmd_check)

    m = sub.add_parser(
        "compare",
        parents=[common],
        formatter_class=_Formatter,
        help="float vs quantized model on data: SQNR, cosine, top-1 agreement, per layer",
        description=_wrap(
            "Run a float model and its quantized version on the same data and print, "
            "for every output, SQNR (dB), cosine similarity, max |error| and top-1 agreement, then "
            "the SQNR of every quantized tensor (matched to the float tensor of the same name), "
            "worst first."
        ),
    )
    m.add_argument("float_model", metavar="FLOAT", help="the float ONNX model")
    m.add_argument("quant_model", metavar="QUANTIZED", help="its quantized (QDQ) version")
    m.add_argument(
        "--data",
        metavar="FILE_OR_DIR",
        help="a .npz/.npy file of input samples or a folder of images (with --preprocess)",
    )
    m.add_argument(
        "--preprocess", metavar="SPEC", help="pre-processing of the images of --data DIR"
    )
    m.add_argument(
        "--random", type=int, metavar="N", help="compare on N random samples instead of data"
    )
    m.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    m.add_argument("--limit", type=int, metavar="N", help="use only the first N samples")
    m.add_argument(
        "--worst",
        type=int,
        default=20,
        metavar="K",
        help="print the K layers of lowest SQNR (default 20; 0: all)",
    )
    m.add_argument(
        "--no-layers", action="store_true", help="compare the graph outputs only (faster)"
    )
    m.add_argument("--json", metavar="PATH", help="also write the full comparison as JSON here")
    m.set_defaults(func=_cmd_compare)

    p = sub.add_parser(
        "presets",
        parents=[common],
        formatter_class=_Formatter,
        help="list the presets and their settings",
        description=_wrap(
            "List the quantization presets (for --config) and the settings each sets."
        ),
    )
    p.add_argument("names", nargs="*", metavar="PRESET", help="show only these presets")
    p.add_argument(
        "--all", action="store_true", help="show every setting in force, defaults included"
    )
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=_cmd_presets)

    o = sub.add_parser(
        "options",
        parents=[common],
        formatter_class=_Formatter,
        help="list the extra options (for --set) with type, default and meaning",
        description=_wrap("List the extra options accepted by --set KEY=VALUE."),
    )
    o.add_argument("names", nargs="*", metavar="OPTION", help="show only these options")
    o.set_defaults(func=_cmd_options)

    e = sub.add_parser(
        "export",
        parents=[common],
        formatter_class=_Formatter,
        help="write a quantized model as a recipe (JSON + safetensors), GGUF or ONNX",
        description=_wrap(
            "Write a quantized (QDQ) model in another format. recipe: a folder holding "
            "recipe.json (the full configuration, the float model's identity, every quantized "
            "tensor's type and granularity) and params.safetensors (scales, zero points, the "
            "codes of every constant); `quark-onnx import RECIPE_DIR --float-model FLOAT -o "
            "OUT.onnx` rebuilds the model byte for byte without calibration data. The recipe is "
            "checked before it is written: MODEL must be what --float-model quantized with the "
            "given settings gives. gguf: the weight-only quantized tensors (uint4 asymmetric "
            "group 32 as Q4_1, int8 symmetric group 32 as Q8_0) and float initializers, for "
            "llama.cpp-style tools (needs: pip install 'quark_onnx[gguf]'). onnx: the QDQ model "
            "itself, validated and written atomically."
        ),
        epilog="examples:\n"
        "  quark-onnx export out/model.onnx --format recipe --float-model model.onnx \\\n"
        "      --report out/model.report.json -o model.recipe\n"
        "  quark-onnx export out/model.onnx --format recipe --float-model model.onnx \\\n"
        "      --config XINT8 -o model.recipe\n"
        "  quark-onnx export out/model.onnx --format gguf -o model.gguf\n"
        "  quark-onnx export out/model.onnx --format onnx -o copy.onnx --external-data",
    )
    e.add_argument("model", metavar="MODEL", help="the quantized (QDQ) ONNX model")
    e.add_argument(
        "--format",
        required=True,
        choices=("recipe", "gguf", "onnx"),
        help="recipe (folder), gguf (file) or onnx (file)",
    )
    _add_output(
        e, "OUT", "the recipe folder, .gguf file or .onnx file to write (never MODEL itself)"
    )
    _add_float_model(e, "recipe: the float model MODEL was quantized from")
    e.add_argument(
        "--report",
        metavar="REPORT_JSON",
        help="recipe: take the settings from the MODEL.report.json `quantize` wrote",
    )
    _add_settings(
        e,
        default=None,  # None: not given (it conflicts with --report)
        preset_help=f"recipe: the preset MODEL was quantized with (default {_DEFAULT_PRESET})",
        set_help="recipe: a setting MODEL was quantized with on top of the preset (as for "
        "quantize)",
    )
    e.add_argument(
        "--require-exact",
        action="store_true",
        help="gguf: refuse when a tensor would not read back exactly equal to its ONNX values",
    )
    e.add_argument(
        "--external-data",
        action="store_true",
        help="onnx: store tensors of 1 KiB and more in OUT.data beside the model",
    )
    e.add_argument(
        "--overwrite", action="store_true", help="replace an existing output (never MODEL)"
    )
    e.set_defaults(func=_cmd_export)

    i = sub.add_parser(
        "import",
        parents=[common],
        formatter_class=_Formatter,
        help="read a QDQ model into a recipe, or rebuild a quantized model from a recipe",
        description=_wrap(
            "Two directions. SOURCE a QDQ model (written by quark-onnx, by onnxruntime's "
            "quantize_static or by AMD Quark in standard-domain QDQ): write the recipe folder "
            "OUT holding float_model.onnx (the model with every QuantizeLinear/DequantizeLinear "
            "pair removed and the quantized weights dequantized to float), recipe.json and "
            "params.safetensors. SOURCE a recipe folder: rebuild the quantized model OUT.onnx "
            "from it and the float model, without calibration data (--float-model is needed "
            "unless the recipe was imported). QOperator models (QLinearConv, MatMulInteger, ...) "
            "and custom-domain quantize ops are refused, naming the node."
        ),
        epilog="examples:\n"
        "  quark-onnx import ort_quantized.onnx -o model.recipe\n"
        "  quark-onnx import model.recipe -o rebuilt.onnx\n"
        "  quark-onnx import xint8.recipe --float-model model.onnx -o xint8.onnx",
    )
    i.add_argument(
        "source", metavar="SOURCE", help="a QDQ .onnx model, or a recipe folder to rebuild"
    )
    _add_output(i, "OUT", "the recipe folder (SOURCE a model) or the .onnx model (SOURCE a recipe)")
    _add_float_model(i, "rebuilding: the float model the recipe was saved from")
    i.add_argument("--overwrite", action="store_true", help="replace an existing output")
    i.set_defaults(func=_cmd_import)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=_log_level(args), format="%(levelname)s: %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        # SIGTERM unwinds like Ctrl-C so that temporary outputs are removed (nothing partial).
        with model_io.sigterm_as_interrupt():
            return args.func(args)
    except model_io.Terminated:
        print("error: terminated", file=sys.stderr)
        return 143
    except QuarkOnnxError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`quark-onnx options | head`): stop quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as exc:
        # Not an error quark_onnx names itself: still one line, the traceback with --debug.
        print(
            f"error: {type(exc).__name__}: {_one_line(str(exc))[:400]} (internal error; rerun "
            "with --debug for the traceback)",
            file=sys.stderr,
        )
        if args.debug:
            traceback.print_exc()
        return EXIT_FAILED
