"""The ``quark-onnx`` parser (one subparser per command module) and :func:`main`."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from quark_onnx.cli import check, compare, export, import_, options, presets, quantize
from quark_onnx.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    Formatter,
    common_flags,
    configure_logging,
    log_level,
    one_line,
    wrap,
)
from quark_onnx.errors import ConfigError, QuarkOnnxError
from quark_onnx.model_files.files import Terminated, sigterm_as_interrupt

#: The subcommands in the order ``--help`` lists them.
COMMANDS = (quantize, check, compare, presets, options, export, import_)


def build_parser() -> argparse.ArgumentParser:
    """The ``quark-onnx`` argument parser (every flag documented in its ``--help``)."""
    from quark_onnx import __version__

    parser = argparse.ArgumentParser(
        prog="quark-onnx",
        description=wrap(
            "Post-training quantization of ONNX models for AMD Vitis AI / Ryzen AI NPUs "
            "(power-of-two XINT8 QDQ models)."
        ),
        epilog="Run `quark-onnx COMMAND --help` for the flags of a command.",
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"quark-onnx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    common = common_flags()
    for command in COMMANDS:
        command.add_parser(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(
        log_level(args), "%(levelname)s: %(name)s: %(message)s", debug=bool(args.debug)
    )
    stdout = sys.stdout
    sys.stdout = _Stdout(stdout)  # type: ignore[assignment]
    try:
        # SIGTERM unwinds like Ctrl-C so that temporary outputs are removed (nothing partial).
        with sigterm_as_interrupt():
            code = args.func(args)
            sys.stdout.flush()  # what is still buffered is written now, its failure named
            return code
    except Terminated:
        print("error: terminated", file=sys.stderr)
        return 143
    except StdoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _drop_stdout()
        return EXIT_FAILED
    except QuarkOnnxError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILED
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout went away (`quark-onnx options | head`): stop quietly.
        _drop_stdout()
        return EXIT_FAILED
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG or exc.filename is None:
            return _internal_error(exc, args.debug)
        # a path the user gave (or one made from it) that no file system takes
        print(f"error: {_too_long(exc.filename)}", file=sys.stderr)
        if args.debug:
            traceback.print_exc()
        return EXIT_USAGE
    except Exception as exc:
        return _internal_error(exc, args.debug)
    finally:
        sys.stdout = stdout


class StdoutError(QuarkOnnxError):
    """The standard output cannot be written (``> /dev/full``, a full disk)."""


class _Stdout:
    """``sys.stdout`` whose write failures are a :class:`StdoutError` (a closed pipe stays a
    ``BrokenPipeError``: the reader went away, which is no error of the run)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _stdout_error(exc) from exc

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _stdout_error(exc) from exc

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def _stdout_error(exc: OSError) -> StdoutError:
    return StdoutError(
        f"cannot write to the standard output ({exc.strerror or exc}): the results are not "
        "printed; redirect the output to a writable file"
    )


def _drop_stdout() -> None:
    """Point the standard output at the null device: the exit's flush of what is still
    buffered then succeeds instead of printing a second error."""
    try:
        fileno = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a file descriptor (a test's capture): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fileno)
    os.close(devnull)


def _too_long(filename: str | bytes) -> str:
    """The one line of a path the file system refuses as too long (ENAMETOOLONG)."""
    path = os.fsdecode(filename)
    shown = path if len(path) <= 120 else f"{path[:80]}...{path[-20:]}"
    longest = max((len(os.fsencode(part)) for part in path.split(os.sep)), default=0)
    return (
        f"{shown!r}: the path is too long for the file system ({len(os.fsencode(path))} bytes, "
        f"its longest name {longest} bytes): choose a shorter path"
    )


def _internal_error(exc: BaseException, debug: bool) -> int:
    """Not an error quark_onnx names itself: still one line, the traceback with ``--debug``."""
    print(
        f"error: {type(exc).__name__}: {one_line(str(exc))[:400]} (internal error; rerun "
        "with --debug for the traceback)",
        file=sys.stderr,
    )
    if debug:
        traceback.print_exc()
    return EXIT_FAILED
