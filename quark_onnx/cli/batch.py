"""The batch: models from paths, output names, the console, the summary table and the runner
that quantizes jobs in this process or in spawned worker processes."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import shutil
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from quark_onnx.cli.common import one_line
from quark_onnx.cli.jobs import Job, Outcome, failed_outcome, quantize_one, worker, worker_init
from quark_onnx.errors import ConfigError
from quark_onnx.model_files.files import Terminated

logger = logging.getLogger("quark_onnx.cli")


def count(n: int, noun: str) -> str:
    """``1 model``, ``2 models``, ``2 processes``: a count with its noun in the right number."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


def collect_models(paths: Sequence[str]) -> list[Path]:
    """Expand folders to the ``*.onnx`` entries directly inside them (sorted); keep files as
    given. A missing file, a broken link or a FIFO named ``*.onnx`` is kept: it fails on its own
    with the reason, not the whole batch, and is never skipped without a word.

    Raises:
        ConfigError: a folder holds no ``.onnx`` file.
    """
    models: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix.lower() == ".onnx" and not q.is_dir())
            if not found:
                raise ConfigError(f"{p}: folder holds no .onnx model")
            models.extend(found)
        else:
            models.append(p)
    return models


def output_names(models: Sequence[Path], names: Sequence[str] | None = None) -> list[str]:
    """The output name of each model: ``names`` (a manifest's), else the file stem.

    Raises:
        ConfigError: two models would write the same output.
    """
    if names is None:
        names = [m.stem if m.suffix.lower() == ".onnx" else m.name for m in models]
    seen: dict[str, Path] = {}
    for model, name in zip(models, names, strict=True):
        if name in seen:
            raise ConfigError(
                f"{seen[name]} and {model} would both be written as {name}.onnx; quantize them "
                "into different output folders (or give them names in the manifest)"
            )
        seen[name] = model
    return list(names)


class Console:
    """Status lines on stderr, with the overall progress bar on a terminal; ``quiet`` (``-q``):
    the error lines only."""

    def __init__(self, total: int, stream: IO[str] | None = None, quiet: bool = False) -> None:
        from quark_onnx.runtime.progress import Progress

        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total = total
        self.quiet = quiet
        self.bar = Progress(
            total,
            desc="models",
            unit="models",
            enabled=self.tty and not quiet,
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
        if not self.quiet:
            self.line(f"[{job.index + 1}/{self.total}] {job.name}: quantizing {job.model}")

    def finished(self, outcome: Outcome, debug: bool) -> None:
        if not outcome.ok:
            self.line(f"error: {outcome.model}: {outcome.message}")
            if debug and outcome.traceback:
                self.stream.write(outcome.traceback)
        elif not self.quiet:
            self.line(
                f"[{outcome.index + 1}/{self.total}] {outcome.name}: done in "
                f"{outcome.seconds:.1f} s"
            )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _fmt_optional(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _fidelity_cells(o: Outcome) -> tuple[str, list[str]]:
    """The verdict's sample count (``16 held-out``) and one ``PART NUMBER`` cell per output part
    (:func:`quark_onnx.pipeline.report.part_number`: the number report.txt shows first)."""
    from quark_onnx.pipeline.report import fidelity_parts, part_number

    fid = o.fidelity or {}
    parts = fidelity_parts(fid) if fid.get("faithful") is not None else []
    if not parts:
        return "-", ["-"]
    samples = f"{fid.get('samples', 0)} {'held-out' if fid.get('held_out') else 'calib'}"
    return samples, [f"{p['part']}: {part_number(p)}" for p in parts]


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """The end-of-run table: model, status, seconds, quantized ops, readiness, fidelity.

    ``faithful`` is the fidelity guard's verdict on every output against the original float
    model (:mod:`quark_onnx.fidelity.verdict`); a model can be ready and not faithful. The
    ``fidelity`` column holds the one number each output part is judged by (its decisions' F1,
    top-1 or per-pixel agreement, else its SQNR), on the verdict's samples (``samples``: how many
    and whether they were held out from calibration), one line per part: the numbers of
    ``MODEL.report.txt`` and, unrounded, ``MODEL.report.json`` (``fidelity.outputs[].parts``).
    """
    header = (
        "model",
        "status",
        "seconds",
        "ops quantized",
        "Vitis AI ready",
        "faithful",
        "samples",
        "fidelity per output part",
    )
    rows = [header]
    for o in outcomes:
        ready = "-" if o.ready is None else ("yes" if o.ready else "no")
        faithful = "-" if o.faithful is None else ("yes" if o.faithful else "NO")
        samples, parts = _fidelity_cells(o)
        status = (
            "ok" if o.ok else ("interrupted" if o.message.startswith("interrupted") else "failed")
        )
        rows.append(
            (
                o.name,
                status,
                f"{o.seconds:.1f}",
                _fmt_optional(o.quantized_nodes, "d"),
                ready,
                faithful,
                samples,
                parts[0],
            )
        )
        rows += [("", "", "", "", "", "", "", part) for part in parts[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    right = {2, 3}
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
        f"{len(outcomes) - failed} of {count(len(outcomes), 'model')} quantized"
        + (f", {failed} failed" if failed else "")
    )
    if any(o.fidelity for o in outcomes):
        lines.append(
            "fidelity: quantized vs float model on the samples held out from calibration (or "
            "calibration samples); per part the number it is judged by: F1 of the decisions "
            "its scores drive, top-1 (score vector), pixels (argmax over the channels per "
            "position), else SQNR (report.txt, report.json)"
        )
    settings = [o for o in outcomes if o.settings_text]
    if settings:
        lines.append("settings:")
        lines += [f"  {o.name}: {o.settings_text}" for o in settings]
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


def _interrupted(job: Job) -> Outcome:
    return failed_outcome(job, "interrupted: not quantized, nothing written")


def _remove_staging(jobs: Sequence[Job]) -> None:
    """Remove the staging folders of jobs whose worker had to be killed: only this run's own
    (named with each job's token), never those of another run writing to the same folder."""
    for job in jobs:
        for leftover in Path(job.out_dir).glob(job.staging_pattern()):
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


def stop_resource_tracker() -> None:
    """Stop and reap multiprocessing's resource tracker (started for the pool's semaphores).

    Left running it outlives this process, and where the process that adopts orphans does not
    reap them (a container's init) it stays behind as a defunct process. Called once the pool is
    garbage: its semaphores are unregistered first, so the tracker has nothing left to clean.
    Python < 3.11 has no ``_stop``: nothing is done there.

    A semaphore still referenced when the batch ends (a frame of an interrupted wait can hold
    the pool's queues past the collection) is unlinked here, before the tracker stops: stopped,
    the tracker unlinks it itself, and the semaphore's own cleanup at exit then fails with a
    traceback on stderr and starts a second tracker. Unlinking only removes the name; a holder
    keeps a working semaphore.
    """
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is None:
        return
    _release_semaphores()
    with contextlib.suppress(Exception):
        stop()
    global _RELEASE_AT_EXIT
    if not _RELEASE_AT_EXIT:
        # a semaphore whose cleanup still runs at exit (seen once in the signal test: its
        # unregister met the stopped tracker's closed pipe and printed a traceback) is released
        # quietly first (atexit runs this before multiprocessing's own exit function)
        atexit.register(_release_semaphores)
        _RELEASE_AT_EXIT = True


_RELEASE_AT_EXIT = False


def _release_semaphores() -> None:
    """Run the pending cleanups of this process's semaphores (unlink, unregister), quietly."""
    from multiprocessing import synchronize, util

    for finalizer in list(util._finalizer_registry.values()):
        if getattr(finalizer, "_callback", None) is synchronize.SemLock._cleanup:
            with contextlib.suppress(Exception):
                finalizer()


def run_batch(jobs: Sequence[Job], workers: int, console: Console, debug: bool) -> list[Outcome]:
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
                max_workers=min(workers, len(jobs)),
                mp_context=context,
                initializer=worker_init,
                initargs=(os.getpid(),),
            )
            try:
                console.line(
                    f"quantizing {count(len(jobs), 'model')} in "
                    f"{count(min(workers, len(jobs)), 'process')}"
                )
                futures = {pool.submit(worker, job): job for job in jobs}
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
                            + (one_line(str(exc)) or type(exc).__name__),
                            traceback=traceback.format_exc(),
                        )
                    console.finished(outcome, debug)
                    done[job.index] = outcome
            except BaseException:
                _stop_pool(pool)
                # the pool's semaphores are cleaned up now, quietly: left to the collector of
                # the interrupted frames, a cleanup once met the tracker's pipe closed (EBADF)
                # and printed a traceback under the summary (fresh-clone CI, SIGINT test)
                _release_semaphores()
                _remove_staging([j for j in jobs if j.index not in done])
                raise
            finally:
                pool.shutdown(wait=True)
    except KeyboardInterrupt as exc:
        console.close()
        name = "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"
        outcomes = [done.get(job.index) or _interrupted(job) for job in jobs]
        raise BatchInterrupted(outcomes, name) from None
    console.close()
    return [done[job.index] for job in jobs]
