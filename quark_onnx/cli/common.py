"""What every command shares: exit codes, the default preset, the parser's building blocks and
the small path checks of the commands that write one file."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from quark_onnx.errors import ConfigError, ModelSaveError
from quark_onnx.model_files.paths import check_output_path

#: Exit codes.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_PRESET = "XINT8"


def one_line(text: str) -> str:
    """``text`` on one line (the CLI prints one line per error)."""
    return " ".join(str(text).split())


def log_level(args: argparse.Namespace) -> int:
    if getattr(args, "quiet", False):
        return logging.ERROR
    if getattr(args, "verbose", False):
        return logging.INFO
    return logging.WARNING


def require_file(path: str, flag: str) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"{flag} {path}: no such file")


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
