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

Exit codes: 0 success; 1 a model failed, is not ready (``check``), or a comparison failed;
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
import dataclasses
import json
import logging
import multiprocessing
import os
import sys
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
_DEFAULT_COMPARE_SAMPLES = 32


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
    compare_samples: int = _DEFAULT_COMPARE_SAMPLES
    save_calibration: bool = False
    load_calibration: str | None = None
    overwrite: bool = False
    log_level: int = logging.WARNING
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
    import numpy as np

    from quark_onnx.calibration import ArrayDataReader, NpzDataReader

    names = [s.name for s in _model_inputs(model)]
    if len(names) == 1:
        return NpzDataReader(path, input_name=names[0], limit=limit)
    try:
        with np.load(path, allow_pickle=False) as archive:
            keys = list(archive.files)
            missing = [n for n in names if n not in keys]
            if missing:
                raise CalibrationError(
                    f"{path}: the model has inputs {names}; the archive has arrays {keys} "
                    f"(missing {missing}): save one array per input, named like the input"
                )
            arrays = {n: archive[n][:limit] if limit else archive[n] for n in names}
    except (OSError, ValueError, AttributeError) as exc:
        raise CalibrationError(f"{path}: not a readable .npz file ({exc})") from exc
    return ArrayDataReader(arrays)


def calibration_reader(settings: QuantizeSettings, model: str | os.PathLike, limit: int | None):
    """The reader of ``--calib`` for ``model`` (None for random or saved calibration)."""
    if settings.calib is None:
        return None
    calib = Path(settings.calib)
    if calib.is_dir():
        from quark_onnx.images import ImageFolderDataReader

        return ImageFolderDataReader(calib, model, settings.preprocess_spec(), limit=limit)
    return npz_reader(calib, model, limit)


def comparison_feeds(
    settings: QuantizeSettings, qconfig: Any, model: str | os.PathLike
) -> Iterator[dict[str, Any]] | None:
    """The first ``compare_samples`` calibration samples (the same as calibration saw first), or
    None when there is no data (a saved calibration result without ``--calib``)."""
    count = settings.compare_samples
    if settings.calib_limit:
        count = min(count, settings.calib_limit)
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
    top1_agreement: float | None = None
    output_sqnr_db: float | None = None
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


def _check_lines(check: dict[str, Any]) -> list[str]:
    findings = check.get("findings", []) if check else []
    lines = []
    for f in sorted(findings, key=lambda f: f.get("severity") != "error"):
        lines.append(f"  {f.get('severity')} {f.get('rule')}: {f.get('message')}")
    return lines


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
    outcome.seconds = time.perf_counter() - start
    return outcome


def _quantize_one(job: Job, outcome: Outcome) -> None:
    from quark_onnx.config import Config
    from quark_onnx.errors import ModelLoadError
    from quark_onnx.model_io import atomic_write_bytes
    from quark_onnx.quantizer import ModelQuantizer

    settings = job.settings
    model_path = Path(job.model)
    if not model_path.is_file():
        raise ModelLoadError(f"{job.model}: no such model file")
    output = job.output
    if output.exists() and not settings.overwrite:
        raise ModelSaveError(
            f"{output} exists; pass --overwrite to replace it, or choose another output folder"
        )
    out_dir = Path(job.out_dir)
    qconfig = settings.build_config()
    quantizer = ModelQuantizer(
        Config(global_quant_config=qconfig),
        calibration_shards=settings.calib_shards,
        shard_backend=settings.shard_backend,
    )
    reader = calibration_reader(settings, model_path, settings.calib_limit)
    load = None
    if settings.load_calibration is not None:
        load = Path(settings.load_calibration)
        if load.is_dir():
            load = load / f"{job.name}.calibration.json"
    save = out_dir / f"{job.name}.calibration.json" if settings.save_calibration else None
    quantizer.quantize_model(
        model_path,
        output,
        reader,
        calibration_result=load,
        save_calibration=save,
        overwrite=settings.overwrite,
    )
    report = quantizer.report
    if report is None:  # pragma: no cover - quantize_model always sets it
        raise QuarkOnnxError(f"{job.model}: the quantizer returned no report")
    _exclude_warnings(job, report)
    outcome.output = str(output)
    outcome.quantized_nodes = (report.plan or {}).get("quantized_nodes")
    outcome.ready = report.ready

    report_json = out_dir / f"{job.name}.report.json"
    report.save(report_json)

    comparison = None
    feeds = comparison_feeds(settings, qconfig, model_path)
    if feeds is not None:
        from quark_onnx.compare import compare_models

        try:
            comparison = compare_models(model_path, output, feeds)
        except QuarkOnnxError as exc:
            logger.warning("%s: float vs quantized comparison failed: %s", job.name, exc)
    if comparison is not None:
        compare_json = out_dir / f"{job.name}.compare.json"
        text = json.dumps(comparison.to_dict(), indent=1)
        atomic_write_bytes(compare_json, text.encode("utf-8"))
        outcome.top1_agreement = comparison.top1_agreement
        outcome.compared_samples = comparison.samples
        if comparison.outputs:
            outcome.output_sqnr_db = comparison.outputs[0].sqnr_db

    lines = [report.summary()]
    lines += _check_lines(report.check)
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
    return quantize_one(job)


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


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """The end-of-run table: model, status, seconds, quantized ops, readiness, accuracy."""
    header = (
        "model",
        "status",
        "seconds",
        "ops quantized",
        "Vitis AI ready",
        "output SQNR dB",
        "top-1 agree",
    )
    rows = [header]
    for o in outcomes:
        ready = "-" if o.ready is None else ("yes" if o.ready else "no")
        agree = (
            f"{o.top1_agreement:.3f} ({o.compared_samples})"
            if o.top1_agreement is not None
            else "-"
        )
        rows.append(
            (
                o.name,
                "ok" if o.ok else "failed",
                f"{o.seconds:.1f}",
                _fmt_optional(o.quantized_nodes, "d"),
                ready,
                _fmt_optional(o.output_sqnr_db, ".1f"),
                agree,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {2, 3, 5}
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
    if any(o.top1_agreement is not None for o in outcomes):
        lines.append(
            "output SQNR and top-1 agree: quantized vs float model on the first calibration "
            "samples (count in brackets)"
        )
    return "\n".join(lines)


def run_batch(jobs: Sequence[Job], workers: int, console: _Console, debug: bool) -> list[Outcome]:
    """Quantize every job (in ``workers`` spawned processes when > 1); outcomes in job order."""
    outcomes: list[Outcome] = []
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            console.started(job)
            outcome = quantize_one(job)
            console.finished(outcome, debug)
            outcomes.append(outcome)
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=min(workers, len(jobs)), mp_context=context
        ) as pool:
            console.line(f"quantizing {len(jobs)} models in {min(workers, len(jobs))} processes")
            futures = {pool.submit(_worker, job): job for job in jobs}
            for future in concurrent.futures.as_completed(futures):
                job = futures[future]
                try:
                    outcome = future.result()
                except Exception as exc:  # the worker process died (out of memory, killed, ...)
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
                outcomes.append(outcome)
    console.close()
    return sorted(outcomes, key=lambda o: o.index)


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
        save_calibration=args.save_calibration,
        load_calibration=args.load_calibration,
        overwrite=args.overwrite,
        log_level=_log_level(args),
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
    out_dir = Path(args.output)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"-o {out_dir}: exists and is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [
        Job(index=i, model=str(m), name=n, out_dir=str(out_dir.resolve()), settings=settings)
        for i, (m, n) in enumerate(zip(models, names, strict=True))
    ]
    console = _Console(len(jobs))
    if args.ray is not None:
        from quark_onnx.ray_runner import run_batch_ray

        outcomes = run_batch_ray(
            jobs, console, args.debug, address=args.ray or None, task_cpus=args.ray_cpus
        )
    else:
        outcomes = run_batch(jobs, args.jobs, console, args.debug)
    print(summary_table(outcomes))
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

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
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
            "go on; the exit code is 1 when any model failed."
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
        help="pre-processing of the images of --calib DIR, e.g. "
        "'resize=256,crop=224,mean=0.485;0.456;0.406,std=0.229;0.224;0.225,scale=1/255,"
        "order=RGB,layout=NCHW' (keys resize, crop, mean, std, scale, order, layout; checked "
        "against the model input shape)",
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
        default=_DEFAULT_COMPARE_SAMPLES,
        metavar="N",
        help="compare the quantized model with the float model on the first N calibration "
        f"samples (default {_DEFAULT_COMPARE_SAMPLES}; 0: do not compare)",
    )
    q.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing outputs in OUT_DIR (default: a model whose output exists fails)",
    )
    q.add_argument(
        "--require-ready",
        action="store_true",
        help="exit with code 1 also when a quantized model is not Vitis AI-ready",
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
