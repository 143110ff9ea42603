"""Files written atomically and read within bounds; temporary files removed on interrupt.

Every file is written to a temporary name (``.<name>.<pid>.<random>.partial``) in the destination
folder and renamed into place only when complete and flushed, so an interrupted run leaves either
the old file or the new one, never a partial file (:func:`atomic_write_bytes`). Reads of
user-named files go through :func:`read_regular_file`: only regular files, never above a limit.

Python does not unwind ``finally`` blocks on ``SIGTERM``: :func:`sigterm_as_interrupt` turns it
into :class:`Terminated` (a ``KeyboardInterrupt``) for the duration of a run, so temporary files
are removed on ``kill`` as on Ctrl-C.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from quark_onnx.errors import ModelLoadError, ModelSaveError, OutputAppearedError

logger = logging.getLogger(__name__)

_PARTIAL_SUFFIX = ".partial"
#: External data is copied between files in pieces of this size.
_COPY_CHUNK = 16 << 20


#: Longest file name component most file systems accept, in bytes.
_NAME_MAX = 255
#: Linux's PATH_MAX: the bytes of a path, its final NUL included
_PATH_MAX = 4096


def check_path_text(path: str | os.PathLike, what: str, error: type[Exception]) -> Path:
    """``path`` as a Path, refusing a NUL byte, a name component above 255 bytes or a path of
    4096 bytes and more (which the operating system refuses with an error that names neither the
    path nor the option)."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise error(f"{what} {text!r}: a path cannot contain a NUL character")
    if len(os.fsencode(text)) >= _PATH_MAX:
        raise error(
            f"{what} {text[:80]!r}...: the path is {len(os.fsencode(text))} bytes long; the "
            f"operating system accepts less than {_PATH_MAX}: choose a shorter path"
        )
    for part in Path(text).parts:
        if len(os.fsencode(part)) > _NAME_MAX:
            raise error(
                f"{what} {text[:80]!r}...: the name {part[:40]!r}... is {len(os.fsencode(part))} "
                f"bytes long; file systems accept at most {_NAME_MAX}: choose a shorter name"
            )
    return Path(text)


def _kind(mode: int) -> str | None:
    """What a node that is not a regular file is, in the words every error uses (None: a file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _not_a_file(label: str, kind: str, what: str) -> str:
    return f"{label}: is {kind}, not a regular file; give the path of the {what}"


def check_regular_file(
    path: str | os.PathLike,
    *,
    what: str,
    error: type[Exception] = ModelLoadError,
    option: str | None = None,
    limit: int | None = None,
) -> int:
    """The size of ``path`` once checked to be a regular file of at most ``limit`` bytes.

    For readers that hand the path to a library (numpy, PIL, onnx): the same words as
    :func:`read_regular_file`, so a FIFO or device is never reported as missing and a huge or
    sparse file is refused before the library reads it. Symbolic links are followed.

    Raises:
        ``error``: naming ``what``, the file and ``option`` (the flag or setting it came from).
    """
    p = check_path_text(path, option or what, error)
    label = f"{option} {p}" if option else str(p)
    try:
        info = os.stat(p)
    except FileNotFoundError:
        raise error(f"{label}: no such file ({what})") from None
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror or exc}); check the path") from exc
    kind = _kind(info.st_mode)
    if kind is not None:
        raise error(_not_a_file(label, kind, what))
    if limit is not None and info.st_size > limit:
        raise error(
            f"{label}: {info.st_size} bytes, above the {limit}-byte limit for a {what}; "
            "this is not the file you meant (or it is corrupt)"
        )
    return info.st_size


def read_regular_file(
    path: str | os.PathLike,
    *,
    limit: int,
    what: str,
    error: type[Exception] = ModelLoadError,
    option: str | None = None,
) -> bytes:
    """The bytes of ``path``, refusing anything but a regular file of at most ``limit`` bytes.

    The one function every file the tool reads whole goes through. Opened without blocking (a
    FIFO never waits for a writer) and checked with ``fstat`` on the open descriptor, so a
    device (``/dev/zero``), FIFO or a link to a huge file is refused before one byte is read; at
    most ``limit + 1`` bytes are ever read (a file that grows meanwhile).

    Raises:
        ``error``: naming ``what``, the file and ``option`` (the flag or setting it came from).
    """
    p = check_path_text(path, option or what, error)
    label = f"{option} {p}" if option else str(p)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise error(f"{label}: no such file ({what})") from None
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror or exc}); check the path") from exc
    try:
        info = os.fstat(fd)
        kind = _kind(info.st_mode)
        if kind is not None:
            raise error(_not_a_file(label, kind, what))
        if info.st_size > limit:
            raise error(
                f"{label}: {info.st_size} bytes, above the {limit}-byte limit for a {what}; "
                "this is not the file you meant (or it is corrupt)"
            )
        chunks = []
        left = limit + 1
        while left > 0:
            piece = os.read(fd, min(left, _COPY_CHUNK))
            if not piece:
                break
            chunks.append(piece)
            left -= len(piece)
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror or exc})") from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise error(f"{label}: grew above the {limit}-byte limit for a {what} while being read")
    return data


#: Temporary files this process has created and not yet renamed or removed. A path is recorded
#: *before* the file is created, so an interrupt (SIGTERM, Ctrl-C) arriving at any instant between
#: creating the file and the caller's ``try`` still finds it: :func:`remove_temporary_files` runs
#: when :func:`sigterm_as_interrupt` exits by an exception and at interpreter exit.
_LIVE_TEMPS: set[Path] = set()


def temp_file_beside(final: Path) -> tuple[int, Path]:
    """An open temporary file in ``final``'s folder, to be renamed onto ``final`` when complete.

    Created with mode 0666 less the umask (what a plainly created file gets, unlike
    ``mkstemp``'s private 0600), named ``.<final name>.<pid>.<random>.partial``. Call
    :func:`temp_file_done` once it has been renamed or removed.
    """
    folder = final.parent if str(final.parent) else Path(".")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = folder / f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}{_PARTIAL_SUFFIX}"
        _LIVE_TEMPS.add(tmp)
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            _LIVE_TEMPS.discard(tmp)
        except BaseException:
            # an interrupt may land after the file was created and before the return: the name
            # holds this process's id, so whatever is there is ours
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            _LIVE_TEMPS.discard(tmp)
            raise
    raise ModelSaveError(f"{final}: could not create a temporary file in {folder}")


def _pid_alive(pid: int) -> bool:
    """Whether a process of this id runs (one of another user counts as running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, owned by someone else
        return True
    return True


def partial_owner(name: str, final_name: str) -> int | None:
    """The process id a temporary name of ``final_name`` carries (``.<final>.<pid>.<...>.partial``),
    None when ``name`` is not one."""
    prefix = f".{final_name}."
    if not (name.startswith(prefix) and name.endswith(_PARTIAL_SUFFIX)):
        return None
    pid, _, _ = name[len(prefix) :].partition(".")
    return int(pid) if pid.isdigit() else None


def remove_stale_partials(final: Path) -> list[Path]:
    """Remove the temporary files and staging folders of ``final`` whose process is gone.

    Every temporary name carries the id of the process that made it (:func:`temp_file_beside`,
    the staging folders of a batch), so one whose process no longer runs was left by a kill or
    a crash: nothing will ever rename it, and it is removed with a note. One whose process runs
    (this one, or a concurrent run) is left alone.
    """
    folder = final.parent if str(final.parent) else Path(".")
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        pid = partial_owner(entry.name, final.name)
        if pid is None or pid == os.getpid() or _pid_alive(pid):
            continue
        path = Path(entry.path)
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(path)
        logger.warning(
            "%s: removed %s, left by process %d which no longer runs (killed or crashed)",
            final,
            path.name,
            pid,
        )
    return removed


def private_temp_folder(kind: str) -> tempfile.TemporaryDirectory[str]:
    """A private folder of this run in the system's temporary folder, ``quark_onnx_<kind>_<pid>_*``
    (spilled reference outputs, a model above 2 GB written for a session), removed when the
    returned object is cleaned up or collected.

    A ``kill -9`` runs no cleanup, so first the folders of this kind whose process no longer runs
    are removed with a note: the folder of a killed run is gone on the next run, as its
    ``.partial`` files are (:func:`remove_stale_partials`)."""
    prefix = f"quark_onnx_{kind}_"
    root = Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid, sep, _ = entry.name[len(prefix) :].partition("_")
            if not (entry.name.startswith(prefix) and sep and pid.isdigit()):
                continue
            if int(pid) == os.getpid() or _pid_alive(int(pid)):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
                logger.warning(
                    "removed %s, left by process %s which no longer runs (killed or crashed)",
                    entry.path,
                    pid,
                )
    return tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}_")


def place_file(tmp: Path, final: Path, *, replace: bool) -> None:
    """Move the complete temporary file ``tmp`` onto ``final``.

    ``replace``: an existing ``final`` is replaced (atomically, ``rename``). Otherwise the
    placement is exclusive: a hard link that fails if ``final`` exists, so of two runs writing
    the same output without overwriting, exactly one succeeds and the other is told the output
    appeared meanwhile (a check made earlier would let both pass). File systems without hard
    links fall back to a check and a rename.

    Raises:
        OutputAppearedError: not ``replace`` and ``final`` exists (``tmp`` is left in place).
        OSError: the rename or link failed otherwise.
    """
    if replace:
        _refuse_special(final)
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final, follow_symlinks=False)
    except FileExistsError:
        raise OutputAppearedError(
            f"{final}: appeared while this run was writing it (another run writing the same "
            "output?); it was not replaced: pass --overwrite (overwrite=True) to replace it, or "
            "choose another output"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        if os.path.lexists(final):
            raise OutputAppearedError(
                f"{final}: appeared while this run was writing it; it was not replaced"
            ) from None
        os.replace(tmp, final)
        return
    os.unlink(tmp)


def temp_file_done(tmp: Path) -> None:
    """``tmp`` (from :func:`temp_file_beside`) was renamed into place or removed."""
    _LIVE_TEMPS.discard(tmp)


def remove_temporary_files() -> None:
    """Remove every temporary file of this process that is still recorded (after an interrupt)."""
    for tmp in list(_LIVE_TEMPS):
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        _LIVE_TEMPS.discard(tmp)


atexit.register(remove_temporary_files)


def text_bytes(text: str) -> bytes:
    """``text`` (a report, a recipe) as the UTF-8 bytes of its file. A path whose name is not
    UTF-8 (Python holds its bytes as surrogate escapes) is written as ``\\udcXX``, as the console
    prints it; in a JSON string that is the escape that reads back as the same name."""
    return text.encode("utf-8", "backslashreplace")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, replace: bool = True) -> None:
    """Write ``data`` to a temporary file beside ``path`` and move it into place
    (:func:`place_file`: ``replace=False`` fails if ``path`` exists by then)."""
    p = Path(path)
    _refuse_special(p)
    try:
        fd, tmp = temp_file_beside(p)
    except OSError as exc:
        raise ModelSaveError(f"{p}: cannot be written ({exc.strerror or exc})") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        place_file(tmp, p, replace=replace)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ModelSaveError(
            f"{p}: cannot be written ({exc.strerror or exc}); check free space and permissions"
        ) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        temp_file_done(tmp)


def _refuse_special(p: Path) -> None:
    """Every rename onto ``p`` goes through here: a device, FIFO or folder is never replaced."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise ModelSaveError(
            f"{p}: exists and is not a regular file (a folder, device, FIFO or socket); it is "
            "never replaced: choose a file path"
        )


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when the process receives ``SIGTERM`` inside
    :func:`sigterm_as_interrupt`; unwinds ``finally`` blocks like Ctrl-C does."""


#: Stop signals received while :func:`sigterm_as_interrupt`'s handlers are installed.
_RECEIVED: list[int] = []


def _raise_terminated(signum: int, frame: object) -> None:
    _RECEIVED.append(signum)
    raise Terminated(f"received signal {signum}")


def _raise_interrupt(signum: int, frame: object) -> None:
    _RECEIVED.append(signum)
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, ``SIGTERM`` raises :class:`Terminated` so temporary files are removed.

    A stop signal lands wherever Python next checks for signals, and C code can turn the
    exception raised there into another one (numpy converting a shape reports the
    ``KeyboardInterrupt`` raised during the conversion as a ``TypeError``). So the handlers
    record the signal, and an ordinary exception leaving the block after one was received is
    raised as the interrupt it stands for (chained to it): the run was stopped, not broken.
    ``SIGINT`` gets such a recording handler only where Python's own is installed.

    Only the main thread can install signal handlers: elsewhere (and where ``SIGTERM`` does not
    exist) this does nothing. A handler other than the default one (set by an embedding
    application) is left alone. The previous handlers are restored on exit.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or not hasattr(signal, "SIGTERM")
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return
    first = len(_RECEIVED)
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        yield
    except Exception as exc:
        remove_temporary_files()
        received = _RECEIVED[first:]
        if not received:
            raise
        if received[-1] == signal.SIGTERM:
            raise Terminated(f"received signal {received[-1]}") from exc
        raise KeyboardInterrupt from exc
    except BaseException:
        remove_temporary_files()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
