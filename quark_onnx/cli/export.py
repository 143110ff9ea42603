"""``quark-onnx export MODEL --format recipe|gguf|onnx -o OUT``: a quantized (QDQ) model in
another format (recipe folder, GGUF, or the QDQ model itself validated and re-written).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from quark_onnx.cli.common import (
    DEFAULT_PRESET,
    EXIT_OK,
    Formatter,
    add_float_model,
    add_output,
    add_settings,
    check_not_input,
    require_file,
    wrap,
)
from quark_onnx.cli.settings import QuantizeSettings, parse_assignments
from quark_onnx.errors import ConfigError, ModelSaveError
from quark_onnx.model_files.files import read_regular_file
from quark_onnx.model_files.load import load_model
from quark_onnx.model_files.save import save_model


def _settings_from_report(path: str | os.PathLike) -> Any:
    """The QuantizationConfig recorded in a ``quantize`` report (``MODEL.report.json``)."""
    from quark_onnx.formats.recipe_format import config_from_json

    text = read_regular_file(
        path, limit=64 << 20, what="JSON report", error=ConfigError, option="--report"
    )
    try:
        data = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"--report {path}: not a readable JSON report ({exc})") from exc
    settings = data.get("settings") if isinstance(data, dict) else None
    if not isinstance(settings, dict) or not isinstance(settings.get("extra_options"), dict):
        raise ConfigError(
            f"--report {path}: holds no 'settings' (give the MODEL.report.json that "
            "`quark-onnx quantize` wrote beside the model)"
        )
    settings = dict(settings)
    extra = settings.pop("extra_options")
    return config_from_json({"settings": settings, "extra_options": extra}, f"--report {path}")


def run(args: argparse.Namespace) -> int:
    require_file(args.model, "MODEL")
    if args.format == "recipe":
        from quark_onnx.formats.recipe import save_recipe

        if args.float_model is None:
            raise ConfigError(
                "--format recipe needs --float-model FLOAT.onnx (the model MODEL was quantized "
                "from: the recipe records its identity and rebuilds from it)"
            )
        require_file(args.float_model, "--float-model")
        if args.report is not None and (args.set or args.config is not None):
            raise ConfigError("give either --report or --config/--set, not both")
        preset = None
        if args.report is not None:
            qconfig = _settings_from_report(args.report)
        else:
            preset = args.config or DEFAULT_PRESET
            qconfig = QuantizeSettings(
                preset=preset, assignments=tuple(parse_assignments(args.set or ()))
            ).build_config()
            if args.set:
                preset = None  # the recorded config is no longer the preset's
        path = save_recipe(
            args.output,
            args.model,
            qconfig,
            args.float_model,
            preset=preset,
            overwrite=args.overwrite,
        )
        print(
            f"{args.model}: recipe written to {path.parent} (verified: it rebuilds the model "
            "byte for byte)"
        )
        return EXIT_OK
    if args.report is not None or args.set or args.config is not None:
        raise ConfigError(f"--report/--config/--set apply to --format recipe, not {args.format}")
    if args.format == "gguf":
        try:
            from quark_onnx.formats.gguf_export import export_gguf
        except ImportError as exc:  # pragma: no cover - the module ships with the package
            raise ModelSaveError(
                f"GGUF export is not available ({exc}); pip install 'quark_onnx[gguf]'"
            ) from exc
        check_not_input(args.output, args.model, args.overwrite)
        summary = export_gguf(
            args.model, args.output, require_exact=args.require_exact, replace=args.overwrite
        )
        counts = ", ".join(f"{n} {t}" for t, n in sorted(summary.get("counts", {}).items()))
        print(
            f"{args.model}: wrote {summary.get('path', args.output)}: "
            f"{summary.get('quantized', 0)} quantized tensor(s); {counts or 'no tensor'}"
        )
        skipped = summary.get("skipped", [])
        if skipped and args.verbose:
            for item in skipped:
                print(f"  skipped {item.get('name')}: {item.get('reason')}")
        elif skipped:
            print(f"  {len(skipped)} initializer(s) not written (-v lists them with the reason)")
        return EXIT_OK
    # onnx: the QDQ model itself, validated and written atomically
    check_not_input(args.output, args.model, args.overwrite)
    proto = load_model(args.model, upgrade_opset=False)
    save_model(
        proto,
        args.output,
        input_path=args.model,
        external_data=True if args.external_data else None,
        replace=args.overwrite,
    )
    print(f"{args.model}: written to {args.output}")
    return EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add this subcommand to ``sub``."""
    e = sub.add_parser(
        "export",
        parents=[common],
        formatter_class=Formatter,
        help="write a quantized model as a recipe (JSON + safetensors), GGUF or ONNX",
        description=wrap(
            "Write a quantized (QDQ) model in another format. recipe: a folder holding "
            "recipe.json (the full configuration, the float model's identity, every quantized "
            "tensor's type and granularity) and params.safetensors (scales, zero points, the "
            "codes of every constant); `quark-onnx import RECIPE_DIR --float-model FLOAT -o "
            "OUT.onnx` rebuilds the model byte for byte without calibration data. The recipe is "
            "checked before it is written: MODEL must be what --float-model quantized with the "
            "given settings gives. gguf: the weight-only quantized tensors (uint4 asymmetric "
            "group 32 as Q4_1, int8 symmetric group 32 as Q8_0) and float initializers, for "
            "llama.cpp-style tools (needs: pip install 'quark_onnx[gguf]'). onnx: the QDQ model "
            "itself, validated and written atomically."
        ),
        epilog="examples:\n"
        "  quark-onnx export out/model.onnx --format recipe --float-model model.onnx \\\n"
        "      --report out/model.report.json -o model.recipe\n"
        "  quark-onnx export out/model.onnx --format recipe --float-model model.onnx \\\n"
        "      --config XINT8 -o model.recipe\n"
        "  quark-onnx export out/model.onnx --format gguf -o model.gguf\n"
        "  quark-onnx export out/model.onnx --format onnx -o copy.onnx --external-data",
    )
    e.add_argument("model", metavar="MODEL", help="the quantized (QDQ) ONNX model")
    e.add_argument(
        "--format",
        required=True,
        choices=("recipe", "gguf", "onnx"),
        help="recipe (folder), gguf (file) or onnx (file)",
    )
    add_output(
        e, "OUT", "the recipe folder, .gguf file or .onnx file to write (never MODEL itself)"
    )
    add_float_model(e, "recipe: the float model MODEL was quantized from")
    e.add_argument(
        "--report",
        metavar="REPORT_JSON",
        help="recipe: take the settings from the MODEL.report.json `quantize` wrote",
    )
    add_settings(
        e,
        default=None,  # None: not given (it conflicts with --report)
        preset_help=f"recipe: the preset MODEL was quantized with (default {DEFAULT_PRESET})",
        set_help="recipe: a setting MODEL was quantized with on top of the preset (as for "
        "quantize)",
    )
    e.add_argument(
        "--require-exact",
        action="store_true",
        help="gguf: refuse when a tensor would not read back exactly equal to its ONNX values",
    )
    e.add_argument(
        "--external-data",
        action="store_true",
        help="onnx: store tensors of 1 KiB and more in OUT.data beside the model",
    )
    e.add_argument(
        "--overwrite", action="store_true", help="replace an existing output (never MODEL)"
    )
    e.set_defaults(func=run)
