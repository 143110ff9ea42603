"""Does the fidelity guard's measurement pick the models the refinement helps?

::

    python benchmarks/bench_refinement.py [--models digits,squeezenet,mobilenetv2,person,ppocr]

For each shared model (``bench_fidelity``'s data), quantizes with the XINT8 preset twice, the
refinement (``FidelityRefine``) off in both: as the preset is, and with the refinement's
rounding forced on (``include_fast_ft``, ``FastFinetune`` gptq with Target ``debiased``). Prints
per version the guard's own measurement (its samples are among the ones the rounding fits on),
the output SQNR and cosine on calibration samples nothing was fitted on (the second half of the
calibration set, at least from sample 32 on), the test images' SQNR and task measure, and
whether :func:`quark_onnx.pipeline.repair.dominates` keeps the rounding. Output:
``results/refinement_probe.{txt,json}``.

``--unseen det6t:seed`` (a ``bench_unseen`` model and option set) instead compares the two
versions image by image: each one's output SQNR and on how many images the rounding's error is
the smaller, on the guard's 16 calibration images (which the rounding was fitted on) and on the
32 test images.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_accuracy
import bench_fidelity as bf
import common

MODELS = ("digits", "squeezenet", "mobilenetv2", "person", "ppocr")


def _fidelity(f: dict[str, np.ndarray], q: dict[str, np.ndarray]) -> tuple[float, float]:
    """Min output SQNR (dB) and the first output's mean per-sample cosine."""
    rows = [bf.output_fidelity(f[n], q[n]) for n in f]
    return min(r["sqnr_db"] for r in rows), rows[0]["cosine"]


def _quantize(entry: Any, rounding: bool, out: Path) -> tuple[Any, float]:
    import onnx

    from quark_onnx import Config, ModelQuantizer

    qc = bf.make_config("preset")
    qc.extra_options["FidelityRefine"] = False
    if rounding:
        qc.include_fast_ft = True
        qc.extra_options["FastFinetune"] = {"OptimAlgorithm": "gptq", "Target": "debiased"}
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    name = onnx.load(str(entry.float_path), load_external_data=False).graph.input[0].name
    start = time.perf_counter()
    quantizer.quantize_model(
        str(entry.float_path), str(out), bench_accuracy._Reader(name, entry.calib), overwrite=True
    )
    return quantizer.report, time.perf_counter() - start


def measure(name: str) -> list[dict[str, Any]]:
    from quark_onnx.fidelity.verdict import FidelityResult, OutputFidelity
    from quark_onnx.pipeline.repair import dominates

    entry = bf.load_entry(name)
    original = Path(bench_accuracy.MODELS.get(entry.base, entry.float_path))
    f_test = bf.run_all(original, entry.test)
    held = entry.calib[max(32, len(entry.calib) // 2) :]
    f_held = bf.run_all(original, held)
    top1 = None
    if entry.labels is not None:
        first = next(iter(f_test.values())).reshape(len(entry.test), -1)
        top1 = float(np.mean(first.argmax(axis=1) == entry.labels))
    rows, guards = [], []
    for rounding in (False, True):
        out = bf.WORK / "out" / f"{name}.refinement_probe.{int(rounding)}.onnx"
        report, seconds = _quantize(entry, rounding, out)
        guard = report.fidelity
        guards.append(
            FidelityResult(
                samples=guard["samples"],
                outputs=[OutputFidelity(**o) for o in guard["outputs"]],
                min_sqnr_db=guard["min_sqnr_db"],
                min_agreement=guard["min_agreement"],
            )
        )
        test = bf.evaluate(entry, f_test, out, top1)
        held_sqnr, held_cos = _fidelity(f_held, bf.run_all(out, held))
        rows.append(
            {
                "model": name,
                "rounding": rounding,
                "guard": [
                    {k: o[k] for k in ("name", "sqnr_db", "cosine", "top1_agreement")}
                    for o in guard["outputs"]
                ],
                "held_out_samples": len(held),
                "held_out_sqnr_db": round(held_sqnr, 2),
                "held_out_cosine": round(held_cos, 4),
                "test_sqnr_db": test["min_sqnr_db"],
                "test_top1": test.get("top1"),
                "test_agreement": test.get("agreement"),
                "test_detection": test.get("detection"),
                "seconds": round(seconds, 1),
            }
        )
    rows[1]["kept"] = dominates(guards[1], guards[0])
    return rows


def per_image(key: str, config: str) -> list[str]:
    """Image-by-image comparison on a ``bench_unseen`` model (module doc)."""
    import bench_unseen as bu

    from quark_onnx import get_default_config

    model, path = bu.MODELS[key], bu.model_path(key)
    calib, test = bu.make_images(model.kind, "calib", 100), bu.make_images(model.kind, "val", 32)
    outs = []
    for rounding in (False, True):
        qc = bf.make_config("seed") if config == "seed" else get_default_config("XINT8")
        qc.extra_options["FidelityRefine"] = False
        if rounding:
            qc.include_fast_ft = True
            qc.extra_options["FastFinetune"] = {"OptimAlgorithm": "gptq", "Target": "debiased"}
        out = bf.WORK / "out" / f"{key}.{config}.refinement_probe.{int(rounding)}.onnx"
        bu.quantize(key, qc, out)
        outs.append(out)
    lines = []
    for label, folder, count in (("guard's 16", calib, 16), ("test 32", test, 32)):
        feeds = bu._feeds(path, model, folder, count)
        f = bu._run(path, feeds)
        errors = []
        for out in outs:
            q = bu._run(out, feeds)
            pairs = zip(f, q, strict=True)
            errors.append(np.array([np.sum((a.astype(np.float64) - b) ** 2) for a, b in pairs]))
        signal = sum(float(np.sum(np.square(a, dtype=np.float64))) for a in f)
        sqnr = [10 * np.log10(signal / e.sum()) for e in errors]
        lines.append(
            f"{key} {config} {label}: SQNR {sqnr[0]:.2f} -> {sqnr[1]:.2f} dB with the rounding, "
            f"its error smaller on {int(np.sum(errors[1] < errors[0]))} of {len(errors[0])} images"
        )
    return lines


def _line(row: dict[str, Any]) -> str:
    guard = row["guard"][0]
    agree = guard["top1_agreement"]
    task = row["test_top1"] if row["test_top1"] is not None else row["test_agreement"]
    det = row["test_detection"]
    if det:
        task = f"matched {det['matched']} of {det['float_boxes']} ({det['quant_boxes']} boxes)"
    return (
        f"{row['model']:12s} {'debiased' if row['rounding'] else 'preset':9s}"
        f" guard {min(o['sqnr_db'] for o in row['guard']):6.2f} dB cos {guard['cosine']:.4f}"
        f" agree {agree if agree is not None else '-'}"
        f" | held-out ({row['held_out_samples']}) {row['held_out_sqnr_db']:6.2f} dB"
        f" | test {row['test_sqnr_db']:6.2f} dB {task}"
        + (f" | kept {row['kept']}" if "kept" in row else "")
        + f" | {row['seconds']} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--unseen", default="", help="MODEL:CONFIG of bench_unseen (module doc)")
    parser.add_argument("--name", default="refinement_probe")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    if args.unseen:
        key, _, config = args.unseen.partition(":")
        lines = per_image(key, config or "repair")
        print("\n".join(lines))
        with (common.RESULTS_DIR / f"{args.name}_unseen.txt").open("a") as f:
            f.write("\n".join(lines) + "\n")
        return 0
    rows: list[dict[str, Any]] = []
    lines = [f"bench_refinement.py {' '.join(sys.argv[1:])}: {common.machine_info()}"]
    for name in args.models.split(","):
        for row in measure(name):
            rows.append(row)
            lines.append(_line(row))
            print(lines[-1], flush=True)
    (common.RESULTS_DIR / f"{args.name}.txt").write_text("\n".join(lines) + "\n")
    (common.RESULTS_DIR / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
