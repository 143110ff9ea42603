"""Peak memory and time of quantizing a large-activation model: a generated 512x896 segmenter.

Run from the repository root::

    python benchmarks/bench_segmenter_memory.py [--samples 64] [--out FILE.json]

The model is built here (onnx.helper, fixed seed): an encoder-decoder of the size of a road
segmentation network (about 85 k weights, 0.34 MB; ``--wide 4``: 16x the weights, 4x every
activation): three 3x3 stride-2 convolutions (3 -> 16 ->
32 -> 64 channels) and one at 1/8 resolution, then three nearest-neighbour 2x upsamplings each
followed by a 3x3 convolution (64 -> 32 -> 16 -> 4 classes), ReLU between; input 1x3x512x896,
output 1x4x512x896 (every full-resolution activation holds 0.46 M positions per channel).

``quark-onnx quantize`` (XINT8, ``--random-calib N``: the calibration samples are generated, so no
data file is needed) runs in a fresh process; from its report: the seconds and the process's
high-water mark after each stage (``peak_rss_mb``), which says which stage set the peak. The
acceptance bound is a peak under 2 GB (1907 MiB) for 64 samples. The float model's inference time
on the same samples is measured in the same run, as the peer for the calibration time.

This is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper


def segmenter(height: int = 512, width: int = 896, seed: int = 0, wide: int = 1) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def conv(x: str, cin: int, cout: int, stride: int, name: str, relu: bool = True) -> str:
        w = rng.normal(0, (2.0 / (cin * 9)) ** 0.5, (cout, cin, 3, 3)).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(w, f"{name}_w"))
        inits.append(onnx.numpy_helper.from_array(np.zeros(cout, np.float32), f"{name}_b"))
        nodes.append(
            helper.make_node(
                "Conv",
                [x, f"{name}_w", f"{name}_b"],
                [name],
                name=name,
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
                strides=[stride, stride],
            )
        )
        if not relu:
            return name
        nodes.append(helper.make_node("Relu", [name], [f"{name}_relu"], name=f"{name}_relu"))
        return f"{name}_relu"

    def up(x: str, name: str) -> str:
        if not any(i.name == "up_scales" for i in inits):
            scales = np.array([1, 1, 2, 2], np.float32)
            inits.append(onnx.numpy_helper.from_array(scales, "up_scales"))
        nodes.append(
            helper.make_node("Resize", [x, "", "up_scales"], [name], name=name, mode="nearest")
        )
        return name

    c1, c2, c3 = 16 * wide, 32 * wide, 64 * wide
    x = conv("input", 3, c1, 2, "enc1")
    x = conv(x, c1, c2, 2, "enc2")
    x = conv(x, c2, c3, 2, "enc3")
    x = conv(x, c3, c3, 1, "mid")
    x = conv(up(x, "up1"), c3, c2, 1, "dec1")
    x = conv(up(x, "up2"), c2, c1, 1, "dec2")
    x = conv(up(x, "up3"), c1, 4, 1, "logits", relu=False)
    graph = helper.make_graph(
        nodes,
        "segmenter",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 4, height, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def float_inference_seconds(path: Path, samples: int) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).uniform(0, 1, (1, 3, 512, 896)).astype(np.float32)
    start = time.perf_counter()
    for _ in range(samples):
        session.run(None, {"input": x})
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=64)
    p.add_argument(
        "--wide", type=int, default=1, help="channel multiplier (4: 64-channel half-res maps)"
    )
    p.add_argument("--out", type=Path, help="also write the results as JSON")
    p.add_argument("--set", action="append", default=[], help="passed to quark-onnx --set")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_segmenter_") as tmp:
        work = Path(tmp)
        model = work / "segmenter.onnx"
        onnx.save(segmenter(wide=args.wide), model)
        model_bytes = model.stat().st_size
        cmd = [
            sys.executable, "-m", "quark_onnx", "quantize", str(model), "-o", str(work / "out"),
            "--random-calib", str(args.samples), "--quiet",
            *[item for s in args.set for item in ("--set", s)],
        ]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            print(done.stdout, done.stderr, file=sys.stderr)
            return 1
        report = json.loads((work / "out" / "segmenter.report.json").read_text())
        peer = float_inference_seconds(model, args.samples)
    result = {
        "samples": args.samples,
        "model_bytes": model_bytes,
        "wall_s": round(wall, 2),
        "float_inference_s": round(peer, 2),
        "timings": report["timings"],
        "peak_rss_mb": report["peak_rss_mb"],
        "process_peak_rss_mb": report["process_peak_rss_mb"],
        "settings": args.set,
        "wide": args.wide,
    }
    print(f"channel multiplier {args.wide}: model {model_bytes} bytes")
    print(
        f"{args.samples} samples: wall {wall:.1f} s (float inference of the samples {peer:.1f} s)"
    )
    print("stage      seconds  high-water MiB")
    for stage, seconds in report["timings"].items():
        print(f"{stage:<10} {seconds:7.2f}  {report['peak_rss_mb'].get(stage, float('nan')):8.0f}")
    print(f"process peak: {report['process_peak_rss_mb']:.0f} MiB")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
