"""Quantize a batch of models as Ray tasks (``quark-onnx quantize --ray``), and run calibration
shards as Ray tasks (``--calib-shards K`` under ``--ray``).

Ray is an optional extra (``pip install 'quark_onnx[ray]'``): nothing here imports it before it is
needed, and ``import quark_onnx`` never does.

Each model is one Ray task that runs the batch runner's own per-model function
(:func:`quark_onnx.cli.jobs.worker`: :func:`quark_onnx.cli.quantize_one`) with the job the driver
built: the same settings, the same output paths, the same outcome -- so outputs, reports and the
summary table are those of ``--jobs``. The task writes the outputs itself, atomically, to the paths
the driver chose (``OUT_DIR/NAME.*``), and runs in the driver's working folder, so relative paths
mean what they mean to the driver. What is shipped to a worker is the job: paths and settings, a
few hundred bytes. The models, the calibration data and the output folder are read and written by
path: on a cluster of several machines they must be on a filesystem every node mounts at the same
path, and quark_onnx (same version) must be installed on every node.

A failing model is an :class:`~quark_onnx.cli.Outcome` like any other (one ``error:`` line); a
task whose worker died (killed, out of memory) is reported the same way. Ctrl-C cancels the tasks
not started and interrupts the running ones, which remove their temporary files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from quark_onnx.cli.batch import count
from quark_onnx.errors import ConfigError
from quark_onnx.model_files.files import Terminated, _raise_terminated
from quark_onnx.runtime.ray_cluster import _cancel, connected, import_ray

logger = logging.getLogger(__name__)


def _package_folder() -> str:
    """The folder of the quark_onnx this process imported."""
    import quark_onnx

    return str(Path(quark_onnx.__file__).resolve().parent)


def _quantize_task(job: Any, cwd: str, driver_package: str | None = None) -> Any:
    """One model, in a Ray worker: the ``--jobs`` worker function, in the driver's folder.

    A worker that imported another quark_onnx than the driver's (``driver_package``: a
    ``quark_onnx`` folder in the working folder, e.g. a source checkout beside a non-editable
    install, comes first on the worker's path) fails in ways that say nothing of the cause: its
    failure then names both packages."""
    outcome = _run_task(job, cwd)
    worker_package = _package_folder()
    if not outcome.ok and driver_package is not None and worker_package != driver_package:
        outcome.message = (
            f"the Ray worker imported quark_onnx from {worker_package}, not the driver's "
            f"{driver_package} (a quark_onnx folder in the working folder {cwd} comes first on "
            "the worker's path): run from another folder, or install this checkout with "
            f"pip install -e; the worker's error: {outcome.message}"
        )
    return outcome


def _run_task(job: Any, cwd: str) -> Any:
    from quark_onnx.cli import jobs

    saved_cwd, saved_stderr = os.getcwd(), sys.stderr
    try:
        os.chdir(cwd)
    except OSError as exc:
        return _failed(
            job,
            f"the Ray worker cannot enter the driver's working folder {cwd} ({exc}); on a "
            "cluster, run from a folder every node mounts at the same path",
        )
    try:
        return jobs.worker(job)
    finally:
        sys.stderr = saved_stderr
        os.chdir(saved_cwd)


def _failed(job: Any, message: str, tb: str = "") -> Any:
    from quark_onnx.cli.jobs import failed_outcome

    return failed_outcome(job, message, tb)


def run_batch_ray(
    jobs: Sequence[Any],
    console: Any,
    debug: bool,
    *,
    address: str | None = None,
    task_cpus: float = 1.0,
    task_memory: int | None = None,
) -> list[Any]:
    """Quantize every job as one Ray task (``task_cpus`` CPUs and ``task_memory`` bytes of
    memory reserved for each); outcomes in job order, as :func:`quark_onnx.cli.run_batch`."""
    if task_cpus <= 0:
        raise ConfigError(f"--ray-cpus {task_cpus}: expected a positive number")
    with _plain_streams(), connected(address) as ray:
        options: dict[str, Any] = {"num_cpus": task_cpus}
        if task_memory:
            options["memory"] = task_memory
        remote = ray.remote(_quantize_task).options(**options)
        cpus = ray.cluster_resources().get("CPU", 0)
        console.line(
            f"quantizing {count(len(jobs), 'model')} as Ray tasks ({cpus:g} CPUs in the "
            f"cluster, {task_cpus:g} per task)"
        )
        cwd, package = os.getcwd(), _package_folder()
        refs = {remote.remote(job, cwd, package): job for job in jobs}
        pending = list(refs)
        outcomes = []
        terminated: list[int] = []
        try:
            with _recording_sigterm(terminated):
                _collect(ray, refs, pending, outcomes, console, debug)
        except KeyboardInterrupt as exc:
            _cancel(ray, pending)
            if terminated and not isinstance(exc, Terminated):
                # Ray turns any exception of a signal handler run inside its wait into a
                # KeyboardInterrupt: SIGTERM stays SIGTERM for the command line (exit 143)
                raise Terminated(f"received signal {terminated[0]}") from None
            raise
        finally:
            console.close()
    return sorted(outcomes, key=lambda o: o.index)


def _collect(
    ray: Any, refs: dict, pending: list, outcomes: list, console: Any, debug: bool
) -> None:
    """Wait for the tasks one by one; ``pending`` shrinks in place (what Ctrl-C cancels)."""
    while pending:
        done, rest = ray.wait(pending, num_returns=1)
        pending[:] = rest
        for ref in done:
            job = refs[ref]
            try:
                outcome = ray.get(ref)
            except Exception as exc:  # the worker died (killed, out of memory, ...)
                text = " ".join(str(getattr(exc, "cause", None) or exc).split())
                outcome = _failed(
                    job,
                    "the Ray task failed: " + (text[:300] or type(exc).__name__),
                    traceback.format_exc(),
                )
            console.finished(outcome, debug)
            outcomes.append(outcome)


#: An ANSI escape sequence (colour, cursor movement), as Ray writes around its workers' lines.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _PlainStream:
    """A stream that drops ANSI escape sequences (a log file is not a terminal)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(_ANSI.sub("", text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _plain_streams() -> Iterator[None]:
    """While Ray is connected, its driver prints the workers' log lines with colour codes
    whether or not stdout/stderr is a terminal: the streams that are not drop them."""
    saved = sys.stdout, sys.stderr
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not getattr(stream, "isatty", lambda: False)():
            setattr(sys, name, _PlainStream(stream))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


@contextlib.contextmanager
def _recording_sigterm(received: list[int]) -> Iterator[None]:
    """While the command line's ``SIGTERM`` handler is in force, also note the signal in
    ``received`` (see :func:`run_batch_ray`)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "SIGTERM")
        or signal.getsignal(signal.SIGTERM) is not _raise_terminated
    ):
        yield
        return

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        _raise_terminated(signum, frame)

    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def quantize_batch_on_ray(
    models: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    settings: Any = None,
    *,
    address: str | None = None,
    task_cpus: float = 1.0,
    task_memory: int | None = None,
    stream: IO[str] | None = None,
) -> list[Any]:
    """Quantize ``models`` (files, or folders of ``*.onnx``) into ``out_dir`` as Ray tasks.

    The API form of ``quark-onnx quantize MODELS -o OUT_DIR --ray [ADDRESS]``: ``settings`` is a
    :class:`quark_onnx.cli.QuantizeSettings` (default: XINT8 defaults; give calibration data, e.g.
    ``QuantizeSettings(random_samples=16)`` or ``calib=...``), ``address`` as in
    :func:`connected`. Status lines go to ``stream`` (default stderr). Returns one
    :class:`quark_onnx.cli.Outcome` per model, in order; a failed model has ``ok=False`` and its
    ``message``, the others are written.

    Raises:
        ConfigError: Ray is not installed, the cluster cannot be reached, two models would write
            the same output, or a folder holds no model.
    """
    from quark_onnx.cli.batch import Console, collect_models, output_names
    from quark_onnx.cli.jobs import Job
    from quark_onnx.cli.settings import QuantizeSettings

    settings = settings if settings is not None else QuantizeSettings()
    import_ray()
    found = collect_models([str(m) for m in models])
    names = output_names(found)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    jobs = [
        Job(index=i, model=str(m), name=n, out_dir=str(folder.resolve()), settings=settings)
        for i, (m, n) in enumerate(zip(found, names, strict=True))
    ]
    console = Console(len(jobs), stream)
    return run_batch_ray(
        jobs, console, False, address=address, task_cpus=task_cpus, task_memory=task_memory
    )
