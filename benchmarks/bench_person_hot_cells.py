"""Where the person detector's quantized scores sit against float's, on the cells that matter.

::

    python benchmarks/bench_person_hot_cells.py QUANTIZED.onnx [QUANTIZED.onnx ...]

Runs the shared person detector (float) and each quantized model on the 500 val images
(``bench_fidelity``'s data) and prints, per quantized model: grid cells whose score (objectness x
person) passes 0.3 in float and in the quantized model, the mean error of the objectness and
person logits and of the score over the cells float puts above 0.3 ("hot") and above 0.15
("near"), and the float detections matched (``bench_fidelity.detection_match``). A detector
whose hot cells' logits sit below float's keeps fewer boxes than float even at a better output
SQNR: the match rate follows the score's bias on those few cells, the SQNR the whole output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fidelity as bf
import common


def _run(path: str, x: np.ndarray) -> np.ndarray:
    session = common.inference_session(path)
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: x[i : i + 1]})[0] for i in range(len(x))])


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p.astype(np.float64), 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def main(paths: list[str]) -> int:
    entry = bf.load_entry("person")
    f = _run(str(entry.float_path), entry.test)
    fs = f[..., 4] * f[..., 5]
    for path in paths:
        q = _run(path, entry.test)
        qs = q[..., 4] * q[..., 5]
        obj, cls = _logit(q[..., 4]) - _logit(f[..., 4]), _logit(q[..., 5]) - _logit(f[..., 5])
        hot, near = fs > bf.DET_SCORE, fs > bf.DET_SCORE / 2
        print(
            f"{Path(path).name}: cells > {bf.DET_SCORE} float {hot.sum()} quantized "
            f"{(qs > bf.DET_SCORE).sum()}; hot: objectness logit {obj[hot].mean():+.3f} person "
            f"logit {cls[hot].mean():+.3f} score {(qs - fs)[hot].mean():+.4f}; near: objectness "
            f"{obj[near].mean():+.3f} person {cls[near].mean():+.3f}; matched "
            f"{bf.detection_match(f, q)['matched']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
