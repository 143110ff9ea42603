"""Paired top-1 of rounding variants against the shipped preset, image by image.

Run from the repository root after ``bench_rounding.py`` wrote the quantized models::

    python benchmarks/bench_paired_top1.py --models squeezenet,mobilenetv2 \
        --variants gptq,gptq_weights

For each model and variant (``benchmarks/.work/fidelity/out/<model>.preset.<variant>.onnx``):
top-1 and float-argmax agreement of both, the images only the variant gets right / only the
shipped model gets right, the exact McNemar p-value of that split, and the same split for
agreement with the float model. Prints JSON lines.

``--pattern`` and ``--base`` name other files of that folder: the preset against the preset with
one technique off as ``bench_fidelity.py --techniques`` writes them::

    python benchmarks/bench_paired_top1.py --models mobilenetv2 --pattern '{model}.{variant}.onnx' \
        --base preset --variants preset.no-EqualizeResidualStreams
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_accuracy
import bench_fidelity as bf
import numpy as np


def _argmax(path: Path, x: np.ndarray) -> np.ndarray:
    return next(iter(bf.run_all(path, x).values())).reshape(len(x), -1).argmax(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="squeezenet,mobilenetv2")
    parser.add_argument("--variants", default="gptq,gptq_weights")
    parser.add_argument("--pattern", default="{model}.preset.{variant}.onnx")
    parser.add_argument("--base", default="shipped", help="the variant the others are paired with")
    args = parser.parse_args(argv)
    for model in args.models.split(","):
        entry = bf.load_entry(model)
        out = bf.WORK / "out"
        f = next(iter(bf.run_all(bf.load_entry(entry.base).float_path, entry.test).values()))
        fa = f.reshape(len(f), -1).argmax(1)

        base = _argmax(out / args.pattern.format(model=model, variant=args.base), entry.test)
        for variant in args.variants.split(","):
            q = _argmax(out / args.pattern.format(model=model, variant=variant), entry.test)
            gained, lost, p = bench_accuracy.mcnemar(q == entry.labels, base == entry.labels)
            ag, al, ap = bench_accuracy.mcnemar(q == fa, base == fa)
            row = {
                "model": model,
                "variant": variant,
                "top1": [round(float(np.mean(base == entry.labels)), 4),
                         round(float(np.mean(q == entry.labels)), 4)],
                "top1_gained_lost_p": [gained, lost, round(p, 3)],
                "agreement": [round(float(np.mean(base == fa)), 4),
                              round(float(np.mean(q == fa)), 4)],
                "agree_gained_lost_p": [ag, al, round(ap, 3)],
                "argmax_differs_from_shipped": int(np.count_nonzero(q != base)),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
