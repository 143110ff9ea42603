"""What every command shares: exit codes, the default preset, the parser's building blocks and
the small path checks of the commands that write one file."""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path

from quark_onnx.errors import ConfigError, ModelSaveError
from quark_onnx.model_files.files import check_regular_file
from quark_onnx.model_files.paths import check_output_path

#: Exit codes.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_PRESET = "XINT8"

#: Most samples a count option of ``compare`` may ask for (``--random``, ``--limit``,
#: ``--worst``): the bound the calibration readers stop a reader of unknown length at
#: (``quark_onnx.calibration.readers.DEFAULT_MAX_FEEDS``; not imported, the CLI starts light).
MAX_SAMPLES = 10_000


def one_line(text: str) -> str:
    """``text`` on one line (the CLI prints one line per error)."""
    return " ".join(str(text).split())


class LogFormatter(logging.Formatter):
    """The CLI's log lines: a record that carries an exception (a library's warning logged with
    its traceback) stays one line, the exception's type and message appended; the traceback is
    printed with ``--debug`` only."""

    def __init__(self, fmt: str, debug: bool = False) -> None:
        super().__init__(fmt)
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if self.debug or not record.exc_info or record.exc_info[1] is None:
            return super().format(record)
        error = record.exc_info[1]
        bare = copy.copy(record)
        bare.exc_info = bare.exc_text = bare.stack_info = None
        return f"{super().format(bare)} ({type(error).__name__}: {one_line(str(error))[:400]})"


def configure_logging(level: int, fmt: str, *, debug: bool = False, force: bool = False) -> None:
    """Log to stderr at ``level`` with :class:`LogFormatter` (as ``logging.basicConfig``: a
    no-op when the root logger has handlers already, unless ``force``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogFormatter(fmt, debug))
    logging.basicConfig(level=level, handlers=[handler], force=force)


def log_level(args: argparse.Namespace) -> int:
    if getattr(args, "quiet", False):
        return logging.ERROR
    if getattr(args, "verbose", False):
        return logging.INFO
    return logging.WARNING


def require_file(path: str, flag: str, what: str = "file") -> None:
    """``path`` (given with ``flag``) is a regular file (a FIFO or device is named as such)."""
    check_regular_file(path, what=what, error=ConfigError, option=flag)


def check_count(value: int | None, flag: str, *, low: int, high: int, meaning: str = "") -> None:
    """A count option within ``[low, high]`` (None: not given). The upper bound keeps a typo
    (``--random 1000000000``) from running for hours or exhausting memory."""
    if value is None or low <= value <= high:
        return
    zero = f" ({meaning})" if meaning else ""
    raise ConfigError(f"{flag} {value}: expected a number from {low}{zero} to {high}")


def check_not_input(output: str, model: str, overwrite: bool) -> None:
    check_output_path(output, Path(model), False)
    if Path(output).exists() and not overwrite:
        raise ModelSaveError(f"{output} exists; pass --overwrite to replace it")


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def common_flags() -> argparse.ArgumentParser:
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


def wrap(text: str) -> str:
    """A help description wrapped to the terminal (the formatter keeps text as written)."""
    import shutil
    import textwrap

    width = min(100, max(40, shutil.get_terminal_size((100, 24)).columns - 2))
    return textwrap.fill(" ".join(text.split()), width)


def preset_names() -> list[str]:
    """The presets in ``configs/`` (every file there is accepted by ``--config``)."""
    from quark_onnx.config.presets import preset_names

    try:
        return preset_names()
    except (OSError, ModuleNotFoundError):  # pragma: no cover - a broken installation
        return [DEFAULT_PRESET]


def add_models(parser: argparse.ArgumentParser, done: str) -> None:
    """The ``MODEL_OR_FOLDER...`` positional of the commands that take many models."""
    parser.add_argument(
        "models",
        nargs="+",
        metavar="MODEL_OR_FOLDER",
        help=f"ONNX model files, or folders whose *.onnx files are all {done}",
    )


def add_output(parser: argparse.ArgumentParser, metavar: str, help: str) -> None:
    """The required ``-o/--output``."""
    parser.add_argument("-o", "--output", required=True, metavar=metavar, help=help)


def add_settings(
    parser: argparse.ArgumentParser, *, default: str | None, preset_help: str, set_help: str
) -> None:
    """``--config/--preset PRESET`` and the repeatable ``--set KEY=VALUE``."""
    parser.add_argument(
        "--config", "--preset", dest="config", default=default, metavar="PRESET", help=preset_help
    )
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help=set_help)


def add_float_model(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--float-model", metavar="FLOAT", help=help)
