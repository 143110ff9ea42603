"""``quark-onnx compare FLOAT QUANTIZED``: float vs quantized on data: per-output SQNR / cosine /
top-1 agreement and per-layer SQNR of the quantized tensors, worst first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from quark_onnx.cli.calibration import calibration_reader
from quark_onnx.cli.common import (
    EXIT_OK,
    MAX_SAMPLES,
    Formatter,
    check_count,
    require_file,
    wrap,
)
from quark_onnx.cli.settings import QuantizeSettings
from quark_onnx.errors import ConfigError
from quark_onnx.model_files.paths import check_output_path


def run(args: argparse.Namespace) -> int:
    from quark_onnx.fidelity.compare import compare_models

    if (args.data is None) == (args.random is None):
        raise ConfigError("compare needs data: give either --data FILE.npz|DIR or --random N")
    if args.preprocess is not None and (args.data is None or not Path(args.data).is_dir()):
        raise ConfigError("--preprocess applies to an image folder given with --data DIR")
    check_count(args.random, "--random", low=1, high=MAX_SAMPLES)
    check_count(args.limit, "--limit", low=1, high=MAX_SAMPLES)
    check_count(args.worst, "--worst", low=0, high=MAX_SAMPLES, meaning="0: all")
    if args.json is not None:  # before any work: never over an input
        check_output_path(
            args.json,
            args.float_model,
            inputs=[args.quant_model, args.data],
            external_data=False,
            what="--json report",
        )
    if args.random is not None:
        from quark_onnx.calibration.sources import random_reader
        from quark_onnx.model_files.load import read_proto

        reader: Any = random_reader(
            read_proto(args.float_model),
            samples=min(args.random, args.limit or args.random),
            seed=args.seed,
        )
    else:
        data = Path(args.data)
        if not data.exists():
            raise ConfigError(f"--data {data}: no such file or folder")
        if not data.is_dir():
            require_file(str(data), "--data", ".npz/.npy file or image folder")
        settings = QuantizeSettings(calib=str(data), preprocess=args.preprocess)
        settings.preprocess_spec()
        reader = calibration_reader(settings, args.float_model, args.limit)
    result = compare_models(
        args.float_model, args.quant_model, iter(reader.get_next, None), layers=not args.no_layers
    )
    print(result.summary(worst=args.worst))
    if args.json is not None:
        from quark_onnx.model_files.files import atomic_write_bytes, text_bytes

        atomic_write_bytes(args.json, text_bytes(json.dumps(result.to_dict(), indent=1)))
    return EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add this subcommand to ``sub``."""
    m = sub.add_parser(
        "compare",
        parents=[common],
        formatter_class=Formatter,
        help="float vs quantized model on data: SQNR, cosine, top-1 agreement, per layer",
        description=wrap(
            "Run a float model and its quantized version on the same data and print, "
            "for every output, SQNR (dB), cosine similarity, max |error| and top-1 agreement, then "
            "the SQNR of every quantized tensor (matched to the float tensor of the same name), "
            "worst first."
        ),
    )
    m.add_argument("float_model", metavar="FLOAT", help="the float ONNX model")
    m.add_argument("quant_model", metavar="QUANTIZED", help="its quantized (QDQ) version")
    m.add_argument(
        "--data",
        metavar="FILE_OR_DIR",
        help="a .npz/.npy file of input samples or a folder of images (with --preprocess)",
    )
    m.add_argument(
        "--preprocess", metavar="SPEC", help="pre-processing of the images of --data DIR"
    )
    m.add_argument(
        "--random", type=int, metavar="N", help="compare on N random samples instead of data"
    )
    m.add_argument("--seed", type=int, default=0, help="seed of --random (default 0)")
    m.add_argument("--limit", type=int, metavar="N", help="use only the first N samples")
    m.add_argument(
        "--worst",
        type=int,
        default=20,
        metavar="K",
        help="print the K layers of lowest SQNR (default 20; 0: all)",
    )
    m.add_argument(
        "--no-layers", action="store_true", help="compare the graph outputs only (faster)"
    )
    m.add_argument("--json", metavar="PATH", help="also write the full comparison as JSON here")
    m.set_defaults(func=run)
