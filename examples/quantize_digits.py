"""Quantize the shipped digits CNN to XINT8 and show what happened.

Runs with only the files in this repository:
    python examples/quantize_digits.py [--out OUT.onnx]

Prints the float and quantized top-1 on the 719 test images, the time taken and the Vitis AI
readiness verdict of the written model and the fidelity guard's verdict.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, QuantType, get_default_config
from quark_onnx.npu.readiness import check

HERE = Path(__file__).resolve().parent / "digits"


def top1(model_path: Path, x: np.ndarray, y: np.ndarray) -> float:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    logits = np.concatenate([session.run(None, {name: x[i : i + 1]})[0] for i in range(len(x))])
    return float((logits.argmax(axis=1) == y).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/digits_cnn.xint8.onnx"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    model = HERE / "digits_cnn.onnx"
    calib = np.load(HERE / "calib.npz")
    test = np.load(HERE / "test.npz")

    quant_config = get_default_config("XINT8")
    quant_config.activation_type = QuantType.QInt8
    quantizer = ModelQuantizer(Config(global_quant_config=quant_config))
    reader = ArrayDataReader({"image": calib["x"]})
    start = time.perf_counter()
    quantizer.quantize_model(str(model), str(args.out), reader)
    seconds = time.perf_counter() - start

    float_acc = top1(model, test["x"], test["y"])
    quant_acc = top1(args.out, test["x"], test["y"])
    # the run measured and undid some passes: the readiness advice must not propose them
    verdict = check(args.out, reverted_passes=quantizer.report.reverted_passes)
    print(
        f"quantized {model.name} -> {args.out} in {seconds:.1f} s "
        f"({quantizer.report.calibration['samples']} of {len(calib['x'])} images calibrate it)"
    )
    print(
        f"top-1 on {len(test['y'])} test images: float {float_acc:.4f}, "
        f"XINT8 {quant_acc:.4f} (drop {100 * (float_acc - quant_acc):.2f} points)"
    )
    fidelity = quantizer.report.fidelity
    outputs = ", ".join(
        f"{o['name']} SQNR {o['sqnr_db']:.1f} dB, top-1 agreement {o['top1_agreement']:.3f}"
        for o in fidelity["outputs"]
    )
    verdict_text = "yes" if fidelity["faithful"] else "NO"
    print(
        f"faithful to the float model: {verdict_text} "
        f"({outputs}; on the {fidelity['samples']} images held out from calibration)"
    )
    print(f"Vitis AI readiness: {verdict.summary()}")


if __name__ == "__main__":
    main()
