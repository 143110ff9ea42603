"""sha256 of the quantized models written for each preset and model, to show a refactoring left
every output byte-identical.

Models: the shared digits_cnn (first 32 calibration images), SqueezeNet 1.1, MobileNetV2,
person_detector_192 and ppocr_direction_cls (4 random samples each, ``UseRandomData``), and the
test graph holding every NPU rule op (``tests/npu/graphs.py``). For XINT8 the readiness finding
counts of each written model are recorded too.

    python benchmarks/hash_outputs.py [--presets XINT8,A8W8] [--out FILE.json]

Run it on two checkouts (e.g. ``PYTHONPATH=<other checkout>``) and compare the JSON files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "models"
sys.path.insert(0, str(REPO / "tests" / "npu"))

from graphs import build  # noqa: E402

import quark_onnx  # noqa: E402
from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config  # noqa: E402
from quark_onnx.check import check  # noqa: E402

PRESETS = "XINT8,A8W8,A16W8,INT8_DYNAMIC,UINT4_WEIGHT_ONLY_G32"
MODELS = (
    "digits_cnn",
    "squeezenet1.1",
    "mobilenetv2_rebuilt",
    "person_detector_192",
    "ppocr_direction_cls",
    "every_rule_op",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results" / "output_sha256.json")
    )
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    tmp = Path(tempfile.mkdtemp())
    onnx.save(build(), tmp / "every_rule_op.onnx")
    out: dict[str, object] = {"code": str(Path(quark_onnx.__file__).parent)}
    for preset in args.presets.split(","):
        for name in MODELS:
            src = tmp / "every_rule_op.onnx" if name == "every_rule_op" else SHARED / f"{name}.onnx"
            qc = get_default_config(preset)
            reader = None
            if name == "digits_cnn":
                calib = np.load(SHARED / "digits_calib.npz")
                reader = ArrayDataReader({"image": calib[calib.files[0]][:32]})
            else:
                qc.extra_options["UseRandomData"] = True
                qc.extra_options["RandomDataSamples"] = 4
            dst = tmp / f"{name}.{preset}.onnx"
            ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
                str(src), str(dst), reader
            )
            out[f"{preset}/{name}"] = hashlib.sha256(dst.read_bytes()).hexdigest()
            if preset == "XINT8":
                out[f"check/{name}"] = check(str(dst)).to_dict()["counts"]
            print(preset, name, out[f"{preset}/{name}"], flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
