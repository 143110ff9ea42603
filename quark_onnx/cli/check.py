"""``quark-onnx check MODEL...``: the Vitis AI readiness check
(:func:`quark_onnx.npu.readiness.check`); exit code 1 when a model is not ready (or cannot be read).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from quark_onnx.cli.batch import collect_models
from quark_onnx.cli.common import EXIT_FAILED, EXIT_OK, Formatter, add_models, wrap
from quark_onnx.cli.jobs import error_message
from quark_onnx.errors import QuarkOnnxError


def reverted_passes(model: str) -> dict[str, str]:
    """The passes the run that wrote ``model`` measured and undid, from the report the CLI
    wrote beside it (``NAME.report.json`` whose ``output`` is this model; none otherwise): so
    the check does not propose them again."""
    from quark_onnx.pipeline.report import QuantizationReport

    path = Path(model)
    beside = path.with_name(f"{path.stem}.report.json")
    try:
        data = json.loads(beside.read_text(encoding="utf-8"))
        if Path(data["output"]).resolve() != path.resolve():
            return {}
        return QuantizationReport(model=data["model"], passes=data["passes"]).reverted_passes
    except (OSError, ValueError, KeyError, TypeError):  # no report, or not this model's
        return {}


def run(args: argparse.Namespace) -> int:
    from quark_onnx.npu.readiness import check

    status = EXIT_OK
    results = []
    models = [str(m) for m in collect_models(args.models)]
    for model in models:
        try:
            result = check(model, reverted_passes=reverted_passes(model))
        except QuarkOnnxError as exc:
            print(f"error: {model}: {error_message(model, exc)}", file=sys.stderr)
            if args.debug:
                traceback.print_exc()
            status = EXIT_FAILED
            results.append({"model": model, "error": error_message(model, exc)})
            continue
        if not result.ready or (args.strict and result.warnings):
            status = EXIT_FAILED
        if args.json:
            results.append(result.to_dict())
        else:
            print(f"{model}: {result.summary()}")
    if args.json:
        print(json.dumps(results if len(models) > 1 else results[0], indent=1))
    return status


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add this subcommand to ``sub``."""
    c = sub.add_parser(
        "check",
        parents=[common],
        formatter_class=Formatter,
        help="is a model ready for the Vitis AI NPU (XINT8)? if not, why",
        description=wrap(
            "Check ONNX models for the Vitis AI / Ryzen AI NPU (XINT8): power-of-two "
            "Q/DQ scales, the NPU shift rules, supported ops, static shapes. Prints every reason a "
            "model is not ready; the exit code is 1 when any model is not ready. A model written "
            "by `quark-onnx quantize` is checked with what its run did (MODEL.report.json beside "
            "it): a pass the run measured and undid is not proposed."
        ),
    )
    add_models(c, "checked")
    c.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")
    c.add_argument(
        "--strict",
        action="store_true",
        help="also fail (exit 1) on warnings (ops that run on the CPU between NPU parts)",
    )
    c.set_defaults(func=run)
