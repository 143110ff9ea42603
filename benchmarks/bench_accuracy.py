"""Accuracy-recovery benchmark: XINT8 top-1 with CLE, bias correction and AdaRound off/on.

Run from the repository root::

    python benchmarks/bench_accuracy.py                          # all three models
    python benchmarks/bench_accuracy.py --models squeezenet --variants base,bc
    python benchmarks/bench_accuracy.py --json benchmarks/.work/accuracy.json

Models and data (../shared):

* ``digits``: ``models/digits_cnn.onnx``, calibration ``digits_calib.npz`` (200 images), test
  ``digits_test.npz`` (719 images);
* ``squeezenet``: SqueezeNet 1.1, ``resize=256,crop=224,mean=104;117;123,std=1;1;1,scale=1,
  order=BGR,layout=NCHW``;
* ``mobilenetv2``: ``resize=256,crop=224,scale=1/255,mean=0.485;0.456;0.406,
  std=0.229;0.224;0.225,order=RGB,layout=NCHW``.

ImageNet models calibrate on the 100 images of ``data/imagenet/calib`` and are scored on the 500
of ``data/imagenet/val`` (labels from its ``labels.txt``; '#' lines are comments). The decoded,
pre-processed arrays are cached under ``benchmarks/.work/accuracy/`` (never in the repository).

Each variant starts from the XINT8 preset with every technique off and switches some on:
``base`` (none), ``cle``
(``include_cle``), ``bc`` (``include_bias_correction``), ``adaround`` (``include_fast_ft``), and
combinations joined with ``+``. For each the benchmark prints top-1, the drop from float in points,
the time of each accuracy stage (``report.timings``), the total quantization time and whether the
output passes :func:`quark_onnx.check`. Top-1 uses onnxruntime's CPU provider with default
optimisations (QDQ fused into int8 kernels, as deployed). This is a benchmark: it prints numbers.

Profiling a stage (bias correction here; pyinstrument is in the test environment)::

    python -m pyinstrument -o /tmp/bc.txt benchmarks/bench_accuracy.py \
        --models mobilenetv2 --variants bc

Each technique is gated so it cannot make a model worse on the data it checks: bias correction
per channel on the held-out half of the kept samples, AdaRound per layer on the held-out half,
CLE per pair by the power-of-two weight noise of the two layers (data free).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
WORK = Path(__file__).resolve().parent / ".work" / "accuracy"

SPECS = {
    "squeezenet": "resize=256,crop=224,mean=104;117;123,std=1;1;1,scale=1,order=BGR,layout=NCHW",
    "mobilenetv2": (
        "resize=256,crop=224,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225,"
        "order=RGB,layout=NCHW"
    ),
}
MODELS = {
    "digits": SHARED / "models" / "digits_cnn.onnx",
    "squeezenet": SHARED / "models" / "squeezenet1.1.onnx",
    "mobilenetv2": SHARED / "models" / "mobilenetv2_rebuilt.onnx",
}
TECHNIQUES = {
    "cle": "include_cle",
    "bc": "include_bias_correction",
    "adaround": "include_fast_ft",
}
DEFAULT_VARIANTS = "base,cle,bc,adaround,cle+bc,cle+bc+adaround"
STAGES = ("calibrate", "adaround", "bias_correction", "prepare")


def read_labels(path: Path) -> dict[str, int]:
    """``file -> class index`` from a labels.txt (tab or space separated; '#' comments)."""
    labels: dict[str, int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        labels[parts[0]] = int(parts[1])
    return labels


def image_arrays(model: str, split: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Pre-processed images of ``data/imagenet/<split>`` for ``model`` (cached), with labels."""
    from quark_onnx.images import ImageFolderDataReader, PreprocessSpec

    cache = WORK / f"{model}_{split}.npz"
    if cache.exists():
        data = np.load(cache)
        return data["x"], data.get("y", None)
    folder = SHARED / "data" / "imagenet" / split
    reader = ImageFolderDataReader(folder, MODELS[model], PreprocessSpec.parse(SPECS[model]))
    xs = []
    while (feed := reader.get_next()) is not None:
        xs.append(next(iter(feed.values())))
    x = np.concatenate(xs).astype(np.float32)
    labels = read_labels(folder / "labels.txt")
    y = np.array([labels.get(Path(f).name, -1) for f in reader.files], dtype=np.int64)
    WORK.mkdir(parents=True, exist_ok=True)
    np.savez(cache, x=x, y=y)
    return x, y


def dataset(model: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(calibration x, test x, test labels)."""
    if model == "digits":
        calib = np.load(SHARED / "models" / "digits_calib.npz")
        test = np.load(SHARED / "models" / "digits_test.npz")
        return calib["x"].astype(np.float32), test["x"].astype(np.float32), test["y"]
    cx, _ = image_arrays(model, "calib")
    tx, ty = image_arrays(model, "val")
    assert ty is not None
    return cx, tx, ty


class _Reader:
    """One sample per ``get_next`` (batch 1, as the NPU model is written)."""

    def __init__(self, name: str, x: np.ndarray) -> None:
        self.name, self.x, self.i = name, x, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.i >= len(self.x):
            return None
        self.i += 1
        return {self.name: self.x[self.i - 1 : self.i]}


def top1(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    import onnxruntime as ort

    data = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    preds = [int(np.argmax(session.run(None, {name: x[i : i + 1]})[0])) for i in range(len(x))]
    return float(np.mean(np.asarray(preds) == y))


def run_variant(model: str, variant: str, cx: np.ndarray, tx: np.ndarray, ty: np.ndarray) -> dict:
    import onnx

    from quark_onnx import Config, ModelQuantizer, get_default_config

    qc = get_default_config("XINT8")
    for field in TECHNIQUES.values():  # a variant names exactly the techniques that are on
        setattr(qc, field, False)
    techniques = [] if variant == "base" else variant.split("+")
    for t in techniques:
        if t not in TECHNIQUES:
            raise SystemExit(f"unknown technique {t!r} (known: {', '.join(TECHNIQUES)})")
        setattr(qc, TECHNIQUES[t], True)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    input_name = onnx.load(str(MODELS[model]), load_external_data=False).graph.input[0].name
    start = time.perf_counter()
    quantized = quantizer.quantize_model(str(MODELS[model]), None, _Reader(input_name, cx))
    seconds = time.perf_counter() - start
    report = quantizer.report
    assert report is not None
    return {
        "model": model,
        "variant": variant,
        "top1": top1(quantized, tx, ty),
        "quantize_seconds": round(seconds, 2),
        "timings": {k: v for k, v in report.timings.items() if k in STAGES},
        "ready": report.ready,
        "bias_saturated": report.bias_correction.get("saturated"),
        "adaround_accepted": report.adaround.get("accepted"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,squeezenet,mobilenetv2")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    results = []
    for model in args.models.split(","):
        cx, tx, ty = dataset(model)
        float_top1 = top1(MODELS[model], tx, ty)
        print(f"\n{model}: float top-1 {float_top1:.4f} on {len(tx)} images", flush=True)
        print(f"  {'variant':<18} {'top-1':>7} {'drop':>6} {'quant s':>8}  stages (s)  ready")
        for variant in args.variants.split(","):
            r = run_variant(model, variant, cx, tx, ty)
            r["float_top1"] = float_top1
            r["drop_points"] = round(100 * (float_top1 - r["top1"]), 2)
            stages = ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items())
            print(
                f"  {variant:<18} {r['top1']:7.4f} {r['drop_points']:6.2f} "
                f"{r['quantize_seconds']:8.1f}  {stages}  {r['ready']}",
                flush=True,
            )
            results.append(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
