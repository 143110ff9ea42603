"""Ray, when it is wanted: importing it with an install hint, connecting to a cluster, cancelling
tasks, and mapping a function over arguments as Ray tasks (calibration shards use this).

Ray is an optional extra (``pip install 'quark_onnx[ray]'``): nothing here imports it before it is
needed, and ``import quark_onnx`` never does. This module knows nothing of the command line, so
the calibration shards can use it without depending on the batch runner
(:mod:`quark_onnx.cli.ray_runner`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from quark_onnx.errors import ConfigError, QuarkOnnxError

logger = logging.getLogger(__name__)


INSTALL_HINT = "pip install 'quark_onnx[ray]'"
#: How long a ``HOST:PORT`` cluster address may take to accept a connection.
CONNECT_TIMEOUT_SECONDS = 10.0
#: How long Ctrl-C waits for interrupted tasks to remove their temporary files.
CANCEL_WAIT_SECONDS = 30.0


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`ConfigError` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(
            f"--ray needs the optional package ray, which is not installed: {INSTALL_HINT}"
        ) from exc
    return ray


@contextlib.contextmanager
def connected(address: str | None = None) -> Iterator[Any]:
    """Ray, connected: to the cluster ``ray`` is already connected to (inside a task, or in a
    program that called ``ray.init``), else to ``address`` (``auto``: the cluster started on
    this machine with ``ray start``; ``ray://HOST:10001``: a remote cluster through Ray Client;
    None: ``RAY_ADDRESS`` if set, else a local cluster started for this run and stopped after).
    """
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    if address:
        _check_reachable(address, f"--ray {address}")
    elif os.environ.get("RAY_ADDRESS"):
        # Ray reads it itself and retries an address nothing answers on for minutes
        _check_reachable(os.environ["RAY_ADDRESS"], f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}")
    with _keep_sigterm_handler():
        try:
            ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
        except (ConnectionError, TimeoutError, ValueError) as exc:
            where = f"--ray {address}" if address else "--ray (RAY_ADDRESS or a local cluster)"
            raise ConfigError(
                f"{where}: cannot connect to a Ray cluster ({' '.join(str(exc).split())}); give "
                "the address printed by `ray start --head` (host:6379), `auto`, or "
                "ray://HOST:10001"
            ) from exc
    try:
        yield ray
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """Undo the ``SIGTERM`` handler ``ray.init`` installs in the driver (``sys.exit``), which it
    does not remove on shutdown: the command line's own handler (temporary outputs removed,
    exit code 143) stays in force."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main and hasattr(signal, "SIGTERM") else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _check_reachable(address: str, where: str) -> None:
    """Fail fast, within :data:`CONNECT_TIMEOUT_SECONDS`, on a ``HOST:PORT`` nothing listens on
    (Ray itself retries for minutes); ``where`` names the source (``--ray ...``,
    ``RAY_ADDRESS=...``). A port out of range is refused as well."""
    host, sep, port = address.strip().rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # ``auto``, ``ray://`` (Ray Client has its own timeout), or not a socket address
    if not 0 < int(port) < 65536:
        raise ConfigError(f"{where}: port {port} is not a TCP port (1..65535)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_SECONDS).close()
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"{where}: nothing answers there ({exc}); give the address printed by "
            "`ray start --head` (HOST:6379), `auto`, or ray://HOST:10001, or unset RAY_ADDRESS"
        ) from exc


def _cancel(ray: Any, refs: Sequence[Any]) -> None:
    """Cancel ``refs``: not started, they never run; running, they get a KeyboardInterrupt and
    unwind (temporary outputs removed). Waits a bounded time for them to end."""
    for ref in refs:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    if refs:
        with contextlib.suppress(Exception):
            ray.wait(list(refs), num_returns=len(refs), timeout=CANCEL_WAIT_SECONDS)


def map_shared(fn: Callable[..., Any], shared: Any, rest: Sequence[tuple]) -> list[Any]:
    """``[fn(shared, *args) for args in rest]`` as Ray tasks of one CPU each, ``shared`` put in
    the object store once; results in order, the first failure re-raised as itself."""
    with connected() as ray:
        ref = ray.put(shared)
        remote = ray.remote(fn).options(num_cpus=1)
        refs = [remote.remote(ref, *args) for args in rest]
        try:
            return ray.get(refs)
        except KeyboardInterrupt:
            _cancel(ray, refs)
            raise
        except Exception as exc:
            cause = getattr(exc, "cause", None)
            _cancel(ray, refs)
            if isinstance(cause, QuarkOnnxError):
                raise cause from None
            raise
