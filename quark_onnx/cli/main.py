"""The ``quark-onnx`` parser (one subparser per command module) and :func:`main`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from quark_onnx.cli import check, compare, export, import_, options, presets, quantize
from quark_onnx.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    Formatter,
    common_flags,
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
    logging.basicConfig(
        level=log_level(args), format="%(levelname)s: %(name)s: %(message)s", stream=sys.stderr
    )
    try:
        # SIGTERM unwinds like Ctrl-C so that temporary outputs are removed (nothing partial).
        with sigterm_as_interrupt():
            return args.func(args)
    except Terminated:
        print("error: terminated", file=sys.stderr)
        return 143
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
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as exc:
        # Not an error quark_onnx names itself: still one line, the traceback with --debug.
        print(
            f"error: {type(exc).__name__}: {one_line(str(exc))[:400]} (internal error; rerun "
            "with --debug for the traceback)",
            file=sys.stderr,
        )
        if args.debug:
            traceback.print_exc()
        return EXIT_FAILED
