"""Would a subsampled MinMSE statistic do? Positions and error from every k-th activation value.

Exact MinMSE needs one histogram update per activation value, which is what keeps calibration at
several times the float inference time (``bench_calibration.py``). The cheap alternative is to
look at every k-th value only. This script measures what that costs in quality on SqueezeNet 1.1
with the 100 calibration images: for every Relu/Concat/MaxPool output it computes the exact
MinMSE position over all values of all samples (:func:`quark_onnx.params.pof2.minmse_position`) and
the position from every k-th value, two ways:

* ``sampled``: the window and the error curve both from the sample;
* ``sampled + exact range``: the window from the exact minimum and maximum (cheap to keep for
  every value), the error curve from the sample.

and prints, per stride, how many tensors get another position and by how much that raises their
squared error over all the data. Run from the repository root (needs ``../shared`` and the cached
arrays of ``bench_peers.py --setup``, about 1.3 GB of RAM)::

    python benchmarks/bench_minmse_sampling.py --strides 7,31,127
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT.parent / "shared" / "models" / "squeezenet1.1.onnx"
CALIB = Path(__file__).resolve().parent / ".work" / "data" / "squeezenet1.1_calib.npy"


def activations(model_path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    """Every Relu/Concat/MaxPool output of the model on every sample, flattened and joined."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(model_path))
    names = [
        o for n in model.graph.node if n.op_type in ("Relu", "Concat", "MaxPool") for o in n.output
    ]
    del model.graph.output[:]
    for name in names:
        model.graph.output.append(
            onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
        )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0].name
    parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for i in range(len(x)):
        for name, value in zip(names, session.run(names, {feed: x[i : i + 1]}), strict=True):
            parts[name].append(value.reshape(-1))
    return {n: np.concatenate(v) for n, v in parts.items()}


def position(values: np.ndarray, window: range | None = None) -> int:
    from quark_onnx.params import pof2

    if window is None:
        return pof2.minmse_position(values)  # reads big arrays in pieces itself
    return pof2.best_position(window, [pof2.sse(values, p) for p in window])


def main(argv: list[str] | None = None) -> int:
    from quark_onnx.params import pof2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strides", default="7,31,127")
    args = parser.parse_args(argv)
    if not CALIB.exists():
        print(f"missing {CALIB}: run `python benchmarks/bench_peers.py --setup` first")
        return 2
    strides = [int(s) for s in args.strides.split(",")]
    acts = activations(MODEL, np.load(CALIB))
    print(f"{len(acts)} tensors, {sum(a.size for a in acts.values()) / 1e6:.0f}M values")
    exact = {name: position(values) for name, values in acts.items()}
    for stride in strides:
        for label, exact_range in (("sampled", False), ("sampled + exact range", True)):
            moved, worst, total = 0, 0.0, 0.0
            for name, values in acts.items():
                sample = values[::stride]
                window = None
                if exact_range:
                    nz = np.abs(values[values != 0])
                    if nz.size == 0:
                        continue
                    window = pof2.minmse_window(
                        float(values.min()), float(values.max()), float(nz.min())
                    )
                p = position(sample, window)
                if p != exact[name]:
                    moved += 1
                    extra = pof2.sse(values, p) / pof2.sse(values, exact[name]) - 1.0
                    worst = max(worst, extra)
                    total += extra
            mean = total / max(moved, 1)
            print(
                f"stride {stride:4d} {label:<22}: {moved:2d} of {len(acts)} tensors move; "
                f"their squared error +{100 * worst:.1f}% worst, +{100 * mean:.1f}% mean",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
