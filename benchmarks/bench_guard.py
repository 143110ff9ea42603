"""Fidelity guard verdicts: does ``report.faithful`` flag the broken models and only those?

Run from the repository root after ``bench_fidelity.py`` (it writes the stress variants and the
person/OCR calibration arrays under ``benchmarks/.work/fidelity/``)::

    python benchmarks/bench_guard.py > benchmarks/results/guard.jsonl

For every shared model and stress variant, the XINT8 preset quantizes it on its calibration data
(as ``bench_fidelity.py`` loads it) and the guard's verdict is printed as one JSON line: faithful
or not, each output's SQNR and top-1 agreement on the guard's samples, and the layer that loses the
most. Stress variants run three times: as the preset, with the range repairs off
(``FoldConstantChannels``, ``include_cle``, ``EqualizeGatedActivations``,
``EqualizeResidualStreams`` and the fidelity repair: "repairs off", the guard's verdict on the
unrepaired model), and with the range repairs off but ``FidelityRepair`` on (what the fidelity
repair then keeps). MobileNetV2 also runs as its ``streams`` variant (residual streams
rescaled; the other models have no stream).
Compare with the measured top-1 and SQNR in ``results/fidelity.txt``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import onnx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_accuracy import SHARED, dataset  # noqa: E402

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config  # noqa: E402

WORK = BENCH / ".work" / "fidelity"
ORIGINALS = {
    "digits": "digits_cnn.onnx",
    "squeezenet": "squeezenet1.1.onnx",
    "mobilenetv2": "mobilenetv2_rebuilt.onnx",
}
VARIANTS = ("rescale", "deadconst", "both")
#: models with residual streams, also run as their ``streams`` variant
STREAM_MODELS = ("mobilenetv2",)


def cases() -> dict[str, tuple[str, Path]]:
    """Case name -> (data set, model path)."""
    out: dict[str, tuple[str, Path]] = {}
    for model, file in ORIGINALS.items():
        out[model] = (model, SHARED / "models" / file)
        for kind in VARIANTS + (("streams",) if model in STREAM_MODELS else ()):
            out[f"{model}_{kind}"] = (model, WORK / f"{model}_{kind}_seed0.onnx")
    out["person"] = ("person", SHARED / "models" / "person_detector_192.onnx")
    out["ppocr"] = ("ppocr", WORK / "ppocr_direction_cls_1x3x48x192.onnx")
    return out


def calibration(data: str) -> np.ndarray:
    if data in ("person", "ppocr"):
        return np.load(WORK / f"{data}_calib.npy")
    return dataset(data)[0]


def verdict(path: Path, x: np.ndarray, repairs_off: bool, fidelity_repair: bool = False) -> dict:
    config = get_default_config("XINT8")
    if repairs_off:
        config.extra_options["FoldConstantChannels"] = False
        config.extra_options["EqualizeGatedActivations"] = False
        config.extra_options["EqualizeResidualStreams"] = False
        config.include_cle = False
        # the guard's own verdict on the unrepaired model; the second row per variant lets the
        # fidelity repair (weights never clipped, no bias correction) try after it fires
        config.extra_options["FidelityRepair"] = fidelity_repair
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    name = onnx.load(str(path), load_external_data=False).graph.input[0].name
    quantizer.quantize_model(str(path), None, ArrayDataReader({name: x}))
    fid = quantizer.report.fidelity
    return {
        "faithful": fid["faithful"],
        "outputs": [(o["name"], o["sqnr_db"], o["top1_agreement"]) for o in fid["outputs"]],
        "worst_layer": next((w["node"] for w in fid.get("worst_layers", [])), None),
        "repair_kept": next((r["repair"] for r in quantizer.report.repairs if r["kept"]), None),
    }


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    logging.disable(logging.WARNING)
    data: dict[str, np.ndarray] = {}
    for name, (source, path) in cases().items():
        if not path.exists():
            print(json.dumps({"model": name, "missing": str(path)}))
            continue
        x = data.setdefault(source, calibration(source))
        modes = [(False, False)]
        if name.endswith((*VARIANTS, "streams")):
            modes += [(True, False), (True, True)]
        for repairs_off, fidelity_repair in modes:
            row = {
                "model": name,
                "repairs_off": repairs_off,
                "fidelity_repair": fidelity_repair or not repairs_off,
                **verdict(path, x, repairs_off, fidelity_repair),
            }
            print(json.dumps(row, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
