"""``quark-onnx presets [PRESET...]``: the presets and the settings each sets."""

from __future__ import annotations

import argparse
import json
from typing import Any

from quark_onnx.cli.common import DEFAULT_PRESET, EXIT_OK, Formatter, wrap


def run(args: argparse.Namespace) -> int:
    from quark_onnx.config.presets import preset_names, read_preset
    from quark_onnx.config.quantization import get_default_config

    # the default preset first, then the others in name order
    names = args.names or sorted(preset_names(), key=lambda n: (n != DEFAULT_PRESET, n))
    data = {}
    for name in names:
        preset = read_preset(name)
        config = get_default_config(name)  # validates the file's keys and values
        if args.all:
            settings = config.effective_settings()
        else:
            settings = {**preset.config, "extra_options": dict(preset.extra_options)}
        data[preset.name] = {"description": preset.description, "settings": settings}
    if args.json:
        print(json.dumps(data, indent=1, default=str))
        return EXIT_OK
    for name, entry in data.items():
        print(f"{name}: {entry['description']}")
        settings = dict(entry["settings"])
        extra = settings.pop("extra_options", {})
        for key, value in settings.items():
            print(f"  {key} = {value!r}" if not isinstance(value, str) else f"  {key} = {value}")
        if extra:
            print("  extra_options:")
            for key, value in extra.items():
                print(f"    {key} = {value!r}")
    if not args.all:
        print("\n(settings the preset file sets; `quark-onnx presets --all` shows every setting)")
    return EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add this subcommand to ``sub``."""
    p = sub.add_parser(
        "presets",
        parents=[common],
        formatter_class=Formatter,
        help="list the presets and their settings",
        description=wrap(
            "List the quantization presets (for --config) and the settings each sets."
        ),
    )
    p.add_argument("names", nargs="*", metavar="PRESET", help="show only these presets")
    p.add_argument(
        "--all", action="store_true", help="show every setting in force, defaults included"
    )
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=run)
