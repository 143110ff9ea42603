"""One model: a :class:`Job` in, an :class:`Outcome` out, every output written through a private
staging folder (runs in the main process, in a ``--jobs`` worker or in a Ray task)."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import secrets
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from quark_onnx.cli.calibration import (
    apply_calibration_shapes,
    budgeted,
    calibration_reader,
    compare_count,
    comparison_feeds,
    preparation_samples_path,
    save_preparation_samples,
    saved_samples_reader,
)
from quark_onnx.cli.common import configure_logging, one_line
from quark_onnx.cli.settings import QuantizeSettings
from quark_onnx.errors import ModelSaveError, QuarkOnnxError
from quark_onnx.model_files.files import (
    _PARTIAL_SUFFIX,
    check_regular_file,
    place_file,
    sigterm_as_interrupt,
)
from quark_onnx.model_files.paths import check_output_path

logger = logging.getLogger("quark_onnx.cli")


@dataclass(frozen=True)
class Job:
    """One model to quantize: its index in the batch, input path, output name and folder."""

    index: int
    model: str
    name: str
    out_dir: str
    settings: QuantizeSettings
    #: this job's identity in its staging folder's name: the folder the run removes on an
    #: interrupt is its own, never that of another run writing to the same folder
    token: str = field(default_factory=lambda: secrets.token_hex(6))
    #: ``--debug``: a worker's log lines keep the tracebacks libraries log with their warnings
    debug: bool = False

    @property
    def output(self) -> Path:
        return Path(self.out_dir) / f"{self.name}.onnx"

    def staging_pattern(self) -> str:
        """The glob of this job's staging folders (whatever process made them)."""
        return f".{glob.escape(self.output.name)}.*.{self.token}{_PARTIAL_SUFFIX}"

    def new_staging(self) -> Path:
        """Create this job's staging folder: ``.<name>.onnx.<pid>.<token>.partial`` (the process
        id lets a later run recognise, and remove, a folder left by a killed process)."""
        path = Path(self.out_dir) / f".{self.output.name}.{os.getpid()}.{self.token}"
        path = path.with_name(path.name + _PARTIAL_SUFFIX)
        path.mkdir(mode=0o700)
        return path


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
    #: the fidelity guard's verdict (``report.fidelity``): the per-part numbers of the summary
    fidelity: dict[str, Any] = field(default_factory=dict)
    #: the settings the model was quantized with, in words (the summary's settings lines)
    settings_text: str = ""
    #: what the model declares about its input, and its float top-1 confidence above chance on
    #: the held-out calibration samples (quark_onnx.cli.consistency: one batch, one source)
    declared_input: dict[str, str] = field(default_factory=dict)
    float_confidence: float | None = None
    message: str = ""
    traceback: str = ""


def error_message(model: str, exc: BaseException) -> str:
    """The message of the one ``error: MODEL: MESSAGE`` line (the model name not repeated)."""
    text = one_line(str(exc)) or type(exc).__name__
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
    from quark_onnx.config.options import did_you_mean
    from quark_onnx.model_files.load import read_proto

    names = [n.name for n in read_proto(job.model).graph.node if n.name]
    for name in missing:
        hint = did_you_mean(name, names)
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
        outcome.fidelity = {}
    outcome.seconds = time.perf_counter() - start
    return outcome


#: What a job may write beside ``NAME``, data file before its model (placed in this order).
_SUFFIXES = (
    ".onnx.data",
    ".onnx",
    ".report.json",
    ".compare.json",
    ".report.txt",
    ".report.html",
    ".calibration.json",
    ".calibration.npz",
)


def _job_outputs(job: Job, *, every: bool = False) -> list[Path]:
    """Every file a job writes into the output folder, data file before its model (``every``:
    also those its settings do not ask for, i.e. every file a run of this name may own)."""
    out_dir = Path(job.out_dir)
    skip = set()
    if not every and not job.settings.report_html:
        skip.add(".report.html")
    if not every and not job.settings.save_calibration:
        skip |= {".calibration.json", ".calibration.npz"}
    return [out_dir / f"{job.name}{s}" for s in _SUFFIXES if s not in skip]


def _guard_job_outputs(job: Job, load: Path | None) -> None:
    """Before any work: no output of the job may be an input (the model, its external data, the
    calibration data or result), a device or FIFO, or (without --overwrite) an existing model."""
    settings = job.settings
    inputs: list[Any] = [settings.calib, load]
    if load is not None:
        inputs.append(preparation_samples_path(load))
    for path in _job_outputs(job):
        if path.name.endswith(".onnx.data"):
            continue  # checked as the model's data file just below
        check_output_path(
            path,
            job.model,
            False,
            inputs=inputs,
            external_data=path.suffix == ".onnx",
            what=f"output {path.name}",
        )


def _quantize_one(job: Job, outcome: Outcome) -> None:
    settings = job.settings
    model_path = Path(job.model)
    check_regular_file(model_path, what="ONNX model")
    final = job.output
    if not settings.overwrite:
        for path in (final, final.with_name(final.name + ".data")):
            if os.path.lexists(path):
                raise ModelSaveError(
                    f"{path} exists; pass --overwrite to replace it, or choose another output "
                    "folder"
                )
    load = None
    if settings.load_calibration is not None:
        load = Path(settings.load_calibration)
        if load.is_dir():
            load = load / f"{job.name}.calibration.json"
    _guard_job_outputs(job, load)
    # Every file is written into a private folder beside the outputs and moved into place only
    # when the whole job succeeded: a job that fails (or is interrupted) leaves nothing behind.
    try:
        staging = job.new_staging()
    except OSError as exc:
        raise ModelSaveError(
            f"{job.out_dir}: cannot create the staging folder of {job.name} "
            f"({exc.strerror or exc}); check free space and permissions"
        ) from exc
    try:
        _quantize_into(job, outcome, staging, load, reader_limit=settings.calib_limit)
        _place_outputs(job, staging)
    except OSError as exc:
        raise ModelSaveError(
            f"{job.out_dir}: cannot write the outputs of {job.name} ({exc.strerror or exc}); "
            "check free space and permissions"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    outcome.output = str(final)


def _place_outputs(job: Job, staging: Path) -> None:
    """Move the staged outputs into the output folder.

    Without ``--overwrite`` the model and its data file are placed exclusively: of two runs
    writing the same model, the second finds it there and fails (what it had placed of its own
    removed again), leaving the first run's files as they are. With ``--overwrite`` every file a
    run of this name owns and this run did not write (the ``.calibration.json``, ``.compare.json``
    or ``.onnx.data`` of the previous run) is removed, so no stale companion stays beside the
    new model.
    """
    exclusive = {job.output, job.output.with_name(job.output.name + ".data")}
    written = [path for path in _job_outputs(job) if (staging / path.name).exists()]
    placed: list[Path] = []
    try:
        for path in written:
            replace = job.settings.overwrite or path not in exclusive
            place_file(staging / path.name, path, replace=replace)
            if not replace:
                placed.append(path)
    except BaseException:
        for path in placed:  # only files placed exclusively: they are this run's own
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise
    if job.settings.overwrite:
        for path in _job_outputs(job, every=True):
            if path not in written and os.path.lexists(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    logger.info("%s: removed %s of the previous run", job.name, path.name)


def _quantize_into(
    job: Job, outcome: Outcome, out_dir: Path, load: Path | None, reader_limit: int | None
) -> None:
    """Quantize ``job`` writing every output into ``out_dir`` (the job's staging folder)."""
    from quark_onnx.config.quantization import Config
    from quark_onnx.model_files.files import atomic_write_bytes, text_bytes
    from quark_onnx.pipeline.quantizer import ModelQuantizer

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
        quantizer.keep_samples = compare_count(settings)
    reader = calibration_reader(settings, model_path, reader_limit)
    if reader is None:
        reader = saved_samples_reader(settings, qconfig, model_path, load)
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
    if save is not None and save.exists():
        save_preparation_samples(settings, qconfig, model_path, preparation_samples_path(save))
    report.output = str(job.output)
    _exclude_warnings(job, report)
    if fixed_shapes:
        report.notes.append(fixed_shapes)
    outcome.quantized_nodes = (report.plan or {}).get("quantized_nodes")
    outcome.ready = report.ready
    outcome.faithful = report.faithful
    outcome.fidelity = report.fidelity

    report_json = out_dir / f"{job.name}.report.json"
    report.save(report_json)  # now, so that a failing comparison leaves the report

    if settings.calib is not None:  # real data: is it the data this model expects?
        from quark_onnx.cli.consistency import declared_input, float_confidence

        try:
            outcome.declared_input = declared_input(model_path)
            outcome.float_confidence = float_confidence(model_path, quantizer.kept_samples)
        except Exception as exc:  # a measurement for a batch warning never fails the model
            logger.debug("%s: input consistency not measured: %s", job.name, exc)

    comparison = None
    feeds: Any = None
    if compare_count(settings) > 0 and quantizer.kept_samples:
        # the verdict's held-out samples (or the calibration's first ones), not read again
        feeds = iter(quantizer.kept_samples)
    else:
        feeds = comparison_feeds(settings, qconfig, model_path)
    if feeds is not None:
        from quark_onnx.fidelity.compare import compare_models
        from quark_onnx.runtime import memory

        feeds = budgeted(settings, feeds)

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
        atomic_write_bytes(compare_json, text_bytes(text))
        outcome.compared_samples = comparison.samples
        if comparison.outputs:
            first = comparison.outputs[0]
            outcome.output_sqnr_db = first.sqnr_db
            outcome.output_cosine = first.cosine
            outcome.agreement = first.agreement
            outcome.agreement_kind = first.agreement_kind

    lines = [report.summary()]
    if comparison is not None:
        which = "held-out" if quantizer.kept_held_out else "first calibration"
        compared = comparison.summary().splitlines()
        if report.fidelity.get("outputs"):
            # the verdict's per-part numbers above are the outputs' fidelity (one number per
            # part, as in the summary table); the comparison adds the layers only
            compared = [line for line in compared if not line.startswith("output ")]
        if len(compared) > 1:
            lines += ["", f"float vs quantized on the {which} samples:", *compared]
    report_txt = out_dir / f"{job.name}.report.txt"
    atomic_write_bytes(report_txt, text_bytes("\n".join(lines) + "\n"))
    if settings.report_html:
        from quark_onnx.pipeline.report_html import render

        compared = comparison.to_dict() if comparison is not None else None
        page = render(report.to_dict(), compared, title=job.name)
        atomic_write_bytes(out_dir / f"{job.name}.report.html", text_bytes(page))


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


def worker(job: Job) -> Outcome:
    """Entry point of a ``--jobs`` worker process (spawned: set up logging afresh)."""
    sys.stderr = _LogStream(sys.stderr)  # type: ignore[assignment]
    configure_logging(
        job.settings.log_level,
        f"%(levelname)s: {job.name}: %(message)s",
        debug=job.debug,
        force=True,
    )
    # SIGTERM (sent by the main process when the batch is interrupted) unwinds the job, so its
    # staging folder is removed; outside a job the default action just ends the worker.
    with sigterm_as_interrupt():
        return quantize_one(job)


def worker_init(parent: int | None = None) -> None:
    """Workers ignore Ctrl-C (the terminal sends it to the whole process group): the main process
    decides, and stops running jobs with SIGTERM. They end with the main process ``parent``
    even when it is killed with SIGKILL (:func:`~quark_onnx.runtime.lifetime.die_with_parent`)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is not None:
        from quark_onnx.runtime.lifetime import die_with_parent

        die_with_parent(parent)


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
