"""What the CLI's float-vs-quantized comparison costs, as a share of the whole quantize run.

Run from the repository root::

    python benchmarks/bench_compare_cost.py [--models squeezenet,mobilenetv2] [--out FILE.json]

For each model, ``quark-onnx quantize MODEL --calib shared/data/imagenet/calib --preprocess
SPEC`` (XINT8, the 100 calibration JPEGs) runs in a fresh process twice: with the default
comparison (the graph outputs on the first 16 calibration samples, which calibration kept) and
with the previous default, the peer measured in the same run (``--compare-samples 32
--compare-layers``: every quantized activation too, on 32 samples). From each run's
``MODEL.report.json``: the ``compare`` stage's seconds and its share of the run (all stages,
compare included), the process's peak RSS after quantizing and after comparing.
The acceptance bound is a share of at most 20 % for the default.

This is a measurement, not a test; timings move by a few percent between runs on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
CALIB = SHARED / "data" / "imagenet" / "calib"
MODELS = {
    "squeezenet": (
        SHARED / "models" / "squeezenet1.1.onnx",
        "resize=256,crop=224,mean=104;117;123,order=BGR",
    ),
    "mobilenetv2": (
        SHARED / "models" / "mobilenetv2_rebuilt.onnx",
        "resize=256,crop=224,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
    ),
}
VARIANTS = {
    "default": [],
    "previous default": ["--compare-samples", "32", "--compare-layers"],
}


def run(model: str, extra: list[str], work: Path) -> dict:
    path, spec = MODELS[model]
    out = work / "out"
    cmd = [
        sys.executable, "-m", "quark_onnx", "quantize", str(path), "-o", str(out), "--calib",
        str(CALIB), "--preprocess", spec, "--overwrite", "--quiet", *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    if done.returncode != 0:
        raise RuntimeError(f"{model}: quantize failed:\n{done.stderr}")
    report = json.loads((out / f"{path.stem}.report.json").read_text())
    timings = report["timings"]
    total = sum(timings.values())
    peaks = report["peak_rss_mb"]
    return {
        "compare_s": round(timings["compare"], 3),
        "total_s": round(total, 3),
        "compare_share": round(timings["compare"] / total, 4),
        "peak_rss_before_compare_mb": peaks.get("save"),
        "peak_rss_mb": report["process_peak_rss_mb"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", type=Path, help="also write the results as JSON")
    args = p.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_compare_") as tmp:
        for model in args.models.split(","):
            results[model] = {}
            for name, extra in VARIANTS.items():
                results[model][name] = run(model, extra, Path(tmp))
    print(f"{'model':<12} {'variant':<18} {'compare s':>9} {'run s':>7} {'share':>6} "
          f"{'RSS before/after compare MiB':>29}")  # fmt: skip
    for model, variants in results.items():
        for name, r in variants.items():
            print(
                f"{model:<12} {name:<18} {r['compare_s']:9.2f} {r['total_s']:7.2f} "
                f"{r['compare_share']:6.1%} {r['peak_rss_before_compare_mb']:>14.0f} / "
                f"{r['peak_rss_mb']:.0f}"
            )
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
