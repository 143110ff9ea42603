"""``quark-onnx import SOURCE -o OUT``: a QDQ model into a recipe folder, or a recipe folder back
into a quantized model without calibration.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from quark_onnx.cli.common import (
    EXIT_OK,
    Formatter,
    add_float_model,
    add_output,
    require_file,
    wrap,
)
from quark_onnx.errors import ConfigError, ModelSaveError
from quark_onnx.model_files.files import check_regular_file


def run(args: argparse.Namespace) -> int:
    from quark_onnx.formats.recipe import import_recipe, load_recipe
    from quark_onnx.formats.recipe_format import RECIPE_FILE

    source = Path(args.source)
    if source.is_dir():
        if not os.path.lexists(source / RECIPE_FILE):
            raise ConfigError(f"{source}: a folder without {RECIPE_FILE}; not a recipe folder")
        if args.float_model is not None:
            require_file(args.float_model, "--float-model")
        out = Path(args.output)
        if out.exists() and not args.overwrite:
            raise ModelSaveError(f"{out} exists; pass --overwrite to replace it")
        load_recipe(source, args.float_model, out, overwrite=args.overwrite)
        print(f"{source}: quantized model rebuilt to {out} (no calibration)")
        return EXIT_OK
    if not os.path.lexists(source):
        raise ConfigError(f"{source}: no such QDQ model file or recipe folder")
    check_regular_file(source, what="QDQ model file or recipe folder", error=ConfigError)
    if args.float_model is not None:
        raise ConfigError(
            "--float-model applies to rebuilding from a recipe folder; importing a QDQ model "
            "writes its float model into the recipe"
        )
    path = import_recipe(source, args.output, overwrite=args.overwrite)
    from quark_onnx.formats.recipe import read_recipe

    recipe = read_recipe(path.parent)
    print(
        f"{source}: {len(recipe.params)} quantized tensor(s) imported into {path.parent} "
        "(recipe.json, params.safetensors, float_model.onnx)"
    )
    return EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add this subcommand to ``sub``."""
    i = sub.add_parser(
        "import",
        parents=[common],
        formatter_class=Formatter,
        help="read a QDQ model into a recipe, or rebuild a quantized model from a recipe",
        description=wrap(
            "Two directions. SOURCE a QDQ model (written by quark-onnx, by onnxruntime's "
            "quantize_static or by AMD Quark in standard-domain QDQ): write the recipe folder "
            "OUT holding float_model.onnx (the model with every QuantizeLinear/DequantizeLinear "
            "pair removed and the quantized weights dequantized to float), recipe.json and "
            "params.safetensors. SOURCE a recipe folder: rebuild the quantized model OUT.onnx "
            "from it and the float model, without calibration data (--float-model is needed "
            "unless the recipe was imported). QOperator models (QLinearConv, MatMulInteger, ...) "
            "and custom-domain quantize ops are refused, naming the node."
        ),
        epilog="examples:\n"
        "  quark-onnx import ort_quantized.onnx -o model.recipe\n"
        "  quark-onnx import model.recipe -o rebuilt.onnx\n"
        "  quark-onnx import xint8.recipe --float-model model.onnx -o xint8.onnx",
    )
    i.add_argument(
        "source", metavar="SOURCE", help="a QDQ .onnx model, or a recipe folder to rebuild"
    )
    add_output(i, "OUT", "the recipe folder (SOURCE a model) or the .onnx model (SOURCE a recipe)")
    add_float_model(i, "rebuilding: the float model the recipe was saved from")
    i.add_argument("--overwrite", action="store_true", help="replace an existing output")
    i.set_defaults(func=run)
