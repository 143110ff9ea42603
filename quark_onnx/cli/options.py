"""``quark-onnx options [OPTION...]``: every extra option with its type, default and meaning."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from quark_onnx.cli.common import EXIT_OK, Formatter, wrap
from quark_onnx.cli.settings import config_field_names
from quark_onnx.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    import typing

    from quark_onnx.config.options import ExtraOptions, closest_name, option_fields

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
            + ", ".join(config_field_names())
        )
    return EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add this subcommand to ``sub``."""
    o = sub.add_parser(
        "options",
        parents=[common],
        formatter_class=Formatter,
        help="list the extra options (for --set) with type, default and meaning",
        description=wrap("List the extra options accepted by --set KEY=VALUE."),
    )
    o.add_argument("names", nargs="*", metavar="OPTION", help="show only these options")
    o.set_defaults(func=run)
