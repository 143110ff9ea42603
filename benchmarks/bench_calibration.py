"""Calibration benchmark on SqueezeNet 1.1: memory independent of samples, time per sample.

Run from the repository root::

    python benchmarks/bench_calibration.py                     # MinMSE, every float tensor
    python benchmarks/bench_calibration.py --method NonOverflow --tensors fused

For each sample count (100 and 1000 by default) a separate subprocess decodes the 100 ImageNet
calibration JPEGs of ../shared (onnxruntime-extensions' DecodeImage, BGR), resizes the short side
to 256 (nearest neighbour), crops the centre 224x224, subtracts the mean (104, 117, 123), and
cycles the images to reach the sample count. It times the float model's inference per sample and
calibration per sample with the same session options (calibration.session_options) in the same
process, and reports its peak RSS (resource.getrusage ru_maxrss). Targets: peak RSS with 1000
samples within 10 % of that with 100; calibration time per sample at most 1.5x the float inference
time per sample. This is a benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "squeezenet1.1.onnx"
IMAGES = SHARED / "data" / "imagenet" / "calib"
MEAN_BGR = (104.0, 117.0, 123.0)


def decode_images() -> list:
    """The calibration JPEGs as 1x3x224x224 float32 BGR minus mean."""
    import numpy as np
    import onnxruntime as ort
    import onnxruntime_extensions
    from onnx import TensorProto, helper

    domain = "com.microsoft.extensions"
    node = helper.make_node("DecodeImage", ["raw"], ["image"], domain=domain)
    graph = helper.make_graph(
        [node],
        "decode",
        [helper.make_tensor_value_info("raw", TensorProto.UINT8, [None])],
        [helper.make_tensor_value_info("image", TensorProto.UINT8, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    )
    model.ir_version = 8
    so = ort.SessionOptions()
    so.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    providers = ["CPUExecutionProvider"]
    session = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    files = sorted(p for p in IMAGES.iterdir() if p.suffix.upper() == ".JPEG")
    out = []
    for path in files:
        raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        img = session.run(None, {"raw": raw})[0]  # H x W x 3, BGR (H x W x 1 for grey JPEGs)
        if img.ndim == 2 or img.shape[2] == 1:
            img = np.repeat(img.reshape(img.shape[0], img.shape[1], 1), 3, axis=2)
        h, w = img.shape[:2]
        scale = 256.0 / min(h, w)
        nh, nw = max(224, round(h * scale)), max(224, round(w * scale))
        rows = np.minimum((np.arange(nh) / scale).astype(np.int64), h - 1)
        cols = np.minimum((np.arange(nw) / scale).astype(np.int64), w - 1)
        img = img[rows][:, cols]
        top, left = (nh - 224) // 2, (nw - 224) // 2
        img = img[top : top + 224, left : left + 224].astype(np.float32)
        img -= np.array(MEAN_BGR, np.float32)
        out.append(np.ascontiguousarray(img.transpose(2, 0, 1)[None]))
    return out


class CyclingReader:
    """``num_samples`` feeds cycling over the decoded images (nothing accumulated)."""

    def __init__(self, images: list, num_samples: int) -> None:
        self.images = images
        self.num_samples = num_samples
        self.i = 0

    def get_next(self):
        if self.i >= self.num_samples:
            return None
        feed = {"data_0": self.images[self.i % len(self.images)]}
        self.i += 1
        return feed


def tensors_to_calibrate(model, which: str) -> list[str]:
    """``all``: the input and every float node output. ``fused``: as ``all`` but without the
    outputs of Conv nodes whose only consumer is a Relu (calibrated after the Relu instead)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in list(inferred.graph.value_info) + list(inferred.graph.output)
    }
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for i in node.input:
            consumers.setdefault(i, []).append(node)
    names = [model.graph.input[0].name]
    for node in model.graph.node:
        for out in node.output:
            if types.get(out) != onnx.TensorProto.FLOAT:
                continue
            users = consumers.get(out, [])
            if (
                which == "fused"
                and node.op_type == "Conv"
                and [u.op_type for u in users] == ["Relu"]
            ):
                continue
            names.append(out)
    return names


def child(num_samples: int, method: str, which: str, pipeline: bool) -> dict:
    import onnx
    import onnxruntime as ort

    from quark_onnx.calibration import session_options
    from quark_onnx.calibration.collector import Collector
    from quark_onnx.enums import coerce_calibrate_method
    from quark_onnx.options import ExtraOptions

    images = decode_images()
    model = onnx.load(str(MODEL))
    names = tensors_to_calibrate(model, which)
    float_session = ort.InferenceSession(
        model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
    )

    def float_time(n: int) -> float:
        reader = CyclingReader(images, n)
        float_session.run(None, reader.get_next())
        start = time.perf_counter()
        while (feed := reader.get_next()) is not None:
            float_session.run(None, feed)
        return (time.perf_counter() - start) / (n - 1)

    n_float = min(num_samples, 200)
    before = float_time(n_float)
    collector = Collector(
        model,
        names,
        method=coerce_calibrate_method(method),
        options=ExtraOptions(),
        pipeline=pipeline,
    )
    start = time.perf_counter()
    result = collector.run(CyclingReader(images, num_samples), progress=False)
    calib = (time.perf_counter() - start) / num_samples
    after = float_time(n_float)
    return {
        "samples": result.num_samples,
        "tensors": len(names),
        "read_from_session": len(collector.sources),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "calib_ms_per_sample": calib * 1e3,
        "float_ms_per_sample": min(before, after) * 1e3,
        "float_ms_before_after": [before * 1e3, after * 1e3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="MinMSE")
    parser.add_argument("--tensors", choices=["all", "fused"], default="all")
    parser.add_argument("--samples", default="100,1000")
    parser.add_argument("--no-pipeline", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.method, args.tensors, not args.no_pipeline)))
        return
    rows = []
    for n in [int(s) for s in args.samples.split(",")]:
        cmd = [sys.executable, __file__, "--child", str(n), "--method", args.method]
        cmd += ["--tensors", args.tensors] + (["--no-pipeline"] if args.no_pipeline else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"squeezenet1.1, method {args.method}, tensors {args.tensors}")
    print(
        f"{'samples':>8} {'tensors':>8} {'read':>5} {'peak RSS MB':>12} {'calib ms/s':>11} "
        f"{'float ms/s':>11} {'ratio':>6}"
    )
    for r in rows:
        ratio = r["calib_ms_per_sample"] / r["float_ms_per_sample"]
        print(
            f"{r['samples']:>8} {r['tensors']:>8} {r['read_from_session']:>5} "
            f"{r['peak_rss_mb']:>12.1f} {r['calib_ms_per_sample']:>11.2f} "
            f"{r['float_ms_per_sample']:>11.2f} {ratio:>6.2f}"
        )
    if len(rows) >= 2:
        growth = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"] - 1.0
        first, last = rows[0]["samples"], rows[-1]["samples"]
        print(f"peak RSS {last} vs {first} samples: {growth * 100:+.1f} % (target within 10 %)")


if __name__ == "__main__":
    main()
