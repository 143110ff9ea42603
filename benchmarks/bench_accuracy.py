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
the fidelity to the float model on the same images (``agree``: share of images whose top-1 class is
the float model's; ``SQNR``: output signal-to-quantization-noise ratio in dB), the time of each
accuracy stage (``report.timings``), the total quantization time and whether the output passes
:func:`quark_onnx.check`. Then, for every pair of variants that differ by one technique, the
paired top-1 split (images only the variant with the technique gets right / only the one without)
with its exact two-sided McNemar p-value, and the change in agreement and SQNR: a top-1 change
of a few images with p well above 0.05 is not evidence either way, while the fidelity columns
say whether the technique brought the outputs closer to the float model. Top-1 uses onnxruntime's
CPU provider with default optimisations (QDQ fused into int8 kernels, as deployed). This is a
benchmark: it prints numbers.

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
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: the benchmark data folder (models/, data/imagenet/): QUARK_ONNX_SHARED, else ../shared
SHARED = Path(os.environ.get("QUARK_ONNX_SHARED", ROOT.parent / "shared")).resolve()
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
    from quark_onnx import ImageFolderDataReader, PreprocessSpec

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


def logits(model: Any, x: np.ndarray) -> np.ndarray:
    """The model's output for every image (batch 1), stacked: ``(N, classes)`` float32."""
    import common

    session = common.inference_session(model)
    name = session.get_inputs()[0].name
    out = [session.run(None, {name: x[i : i + 1]})[0].reshape(-1) for i in range(len(x))]
    return np.stack(out).astype(np.float32)


def fidelity(q: np.ndarray, f: np.ndarray) -> dict[str, float]:
    """How close quantized outputs ``q`` are to the float model's ``f`` (same images).

    ``agreement``: share of images whose top-1 class is the float model's; ``sqnr_db``:
    ``10 log10(sum f^2 / sum (f - q)^2)`` over every output value.
    """
    err = float(np.sum((f.astype(np.float64) - q) ** 2))
    signal = float(np.sum(f.astype(np.float64) ** 2))
    sqnr = 10.0 * np.log10(signal / err) if err > 0 else float("inf")
    agree = float(np.mean(np.argmax(q, axis=1) == np.argmax(f, axis=1)))
    return {"agreement": round(agree, 4), "sqnr_db": round(sqnr, 2)}


def mcnemar(on: np.ndarray, off: np.ndarray) -> tuple[int, int, float]:
    """Exact two-sided McNemar test of two classifiers on the same images.

    ``on``/``off``: per image, whether each got it right. Returns ``(gained, lost, p)``: images
    only ``on`` gets right, images only ``off`` gets right, and the probability of a split at
    least this uneven if both were equally accurate (binomial, n = gained + lost, 1/2).
    """
    gained = int(np.count_nonzero(on & ~off))
    lost = int(np.count_nonzero(off & ~on))
    n = gained + lost
    if n == 0:
        return gained, lost, 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return gained, lost, min(1.0, 2.0 * tail)


def technique_pairs(variants: list[str]) -> list[tuple[str, str, str]]:
    """``(on, off, technique)`` for every variant that differs from another by one technique."""
    sets = {v: frozenset([] if v == "base" else v.split("+")) for v in variants}
    pairs = []
    for on, techs in sets.items():
        for off, fewer in sets.items():
            extra = techs - fewer
            if fewer < techs and len(extra) == 1:
                pairs.append((on, off, next(iter(extra))))
    return pairs


def run_variant(
    model: str, variant: str, cx: np.ndarray, tx: np.ndarray, ty: np.ndarray, f_out: np.ndarray
) -> dict:
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
    q_out = logits(quantized, tx)
    correct = np.argmax(q_out, axis=1) == ty
    return {
        "model": model,
        "variant": variant,
        "top1": float(np.mean(correct)),
        "correct": correct,
        **fidelity(q_out, f_out),
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
        f_out = logits(MODELS[model], tx)
        float_top1 = float(np.mean(np.argmax(f_out, axis=1) == ty))
        print(f"\n{model}: float top-1 {float_top1:.4f} on {len(tx)} images", flush=True)
        print(
            f"  {'variant':<18} {'top-1':>7} {'drop':>6} {'agree':>6} {'SQNR dB':>8} "
            f"{'quant s':>8}  stages (s)  ready"
        )
        variants = args.variants.split(",")
        done: dict[str, dict] = {}
        for variant in variants:
            r = run_variant(model, variant, cx, tx, ty, f_out)
            r["float_top1"] = float_top1
            r["drop_points"] = round(100 * (float_top1 - r["top1"]), 2)
            stages = ", ".join(f"{k} {v:.1f}" for k, v in r["timings"].items())
            print(
                f"  {variant:<18} {r['top1']:7.4f} {r['drop_points']:6.2f} "
                f"{r['agreement']:6.3f} {r['sqnr_db']:8.2f} "
                f"{r['quantize_seconds']:8.1f}  {stages}  {r['ready']}",
                flush=True,
            )
            done[variant] = r
        pairs = technique_pairs(variants)
        if pairs:
            print("  technique on vs off (same images; exact McNemar test of the top-1 split):")
        for on, off, tech in pairs:
            gained, lost, p = mcnemar(done[on]["correct"], done[off]["correct"])
            d_agree = done[on]["agreement"] - done[off]["agreement"]
            d_sqnr = done[on]["sqnr_db"] - done[off]["sqnr_db"]
            print(
                f"    +{tech:<9} {on:<12} vs {off:<12} top-1 {gained:+d}/{-lost:d} images "
                f"(p = {p:.2f}), agreement {100 * d_agree:+.1f} pts, SQNR {d_sqnr:+.2f} dB"
            )
            done[on].setdefault("versus", []).append(
                {"off": off, "technique": tech, "gained": gained, "lost": lost, "p": p}
            )
        for r in done.values():
            r.pop("correct")
            results.append(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
