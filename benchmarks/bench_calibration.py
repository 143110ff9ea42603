"""Calibration benchmark: time per sample against float inference, and peak memory.

Run from the repository root::

    python benchmarks/bench_calibration.py                          # SqueezeNet, every method
    python benchmarks/bench_calibration.py --methods MinMSE --samples 100 --repeats 5
    python benchmarks/bench_calibration.py --model mobilenetv2 --methods MinMSE --no-timing

What is calibrated is what the quantizer calibrates: the model after the XINT8 preset's prepare
passes, and the activation tensors of its plan (``QuantPlan.activation_names``: fused Conv outputs
are not among them, so onnxruntime keeps its Conv+Relu fusions).

Images: the 100 ImageNet calibration JPEGs of ../shared, decoded with onnxruntime-extensions'
DecodeImage, short side resized to 256 (nearest neighbour), centre 224x224 crop, each model's own
normalisation; cycled to reach the sample count.

Time (one subprocess per model and sample count): ``--repeats`` rounds; in each round every method's
calibration is timed between two passes of the float model's inference over the same samples, with
the same session options (``quark_onnx.calibration.session_options``) and the batch calibration
runs (SqueezeNet's batch axis is fixed to 1). The ratio is calibration time over the mean of the
two float passes around it, per round; the median over rounds is reported, with the same ratio in
process CPU time (all threads). The machine may be shared: absolute milliseconds are not comparable
between runs, ratios from the same round are. Target: ratio <= 1.5.

Memory (one fresh subprocess per model, method and sample count): peak RSS of the process
(``ru_maxrss``) and its growth over the RSS before calibration started (model prepared, images
decoded). Target: peak RSS with 1000 samples within 10 % of that with 100.

Where MinMSE's time goes (2 cores, SqueezeNet reads ~2.9 M activation values per sample, float
inference ~3.5 ms): the histogram costs ~5 ns per value in numpy, ~3 ns of it the exact scatter
(``np.add.at``, which holds the GIL), so its ratio stays near 3 -- the floor of an exact per-value
histogram here; NonOverflow and MinMax (~0.3 ns per value) are bound by the session itself.

Profile the calibration loop (pyinstrument is in the project environment)::

    python -m pyinstrument -r text benchmarks/bench_calibration.py --profile MinMSE --samples 200

This is a benchmark, not a test: it prints numbers (and ``--json PATH`` writes them).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from quark_onnx.model_files.load import load_model, to_ir, to_proto

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
IMAGES = SHARED / "data" / "imagenet" / "calib"
MODELS = {
    "squeezenet": SHARED / "models" / "squeezenet1.1.onnx",
    "mobilenetv2": SHARED / "models" / "mobilenetv2_rebuilt.onnx",
}
METHODS = ["MinMSE", "NonOverflow", "MinMax", "Percentile", "Entropy", "MSE"]


def _rss_mb() -> float:
    """Current resident set size (MB) from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def decode_images(model_name: str) -> list:
    """The calibration JPEGs as 1x3x224x224 float32 tensors normalised for ``model_name``."""
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
    session = ort.InferenceSession(
        model.SerializeToString(), so, providers=["CPUExecutionProvider"]
    )
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
        if model_name == "squeezenet":  # BGR, 0-255 minus the mean
            img -= np.array((104.0, 117.0, 123.0), np.float32)
        else:  # RGB, x / 255, ImageNet mean and std
            img = img[:, :, ::-1] / 255.0
            img = (img - np.array((0.485, 0.456, 0.406))) / np.array((0.229, 0.224, 0.225))
        out.append(np.ascontiguousarray(img.transpose(2, 0, 1)[None], dtype=np.float32))
    return out


class CyclingReader:
    """``num_samples`` feeds cycling over the decoded images (nothing accumulated)."""

    def __init__(self, images: list, num_samples: int, input_name: str) -> None:
        self.images = images
        self.num_samples = num_samples
        self.input_name = input_name
        self.i = 0

    def get_next(self):
        if self.i >= self.num_samples:
            return None
        feed = {self.input_name: self.images[self.i % len(self.images)]}
        self.i += 1
        return feed


def prepared_model(path: Path, sample: dict):
    """The model after the XINT8 preset's prepare passes and the activations its plan quantizes."""
    from quark_onnx import get_default_config
    from quark_onnx.pipeline.prepare import quantize_passes, run_passes
    from quark_onnx.plan.build import build_plan

    qconfig = get_default_config("XINT8")
    options = qconfig.validate()
    model = to_ir(load_model(path))
    run_passes(model, quantize_passes(qconfig, options), sample_feeds=sample)
    plan = build_plan(model, qconfig, options)
    return to_proto(model), plan.activation_names()


def _setup(model_name: str):
    import onnx

    images = decode_images(model_name)
    float_model = onnx.load(str(MODELS[model_name]))
    input_name = float_model.graph.input[0].name
    prepared, names = prepared_model(MODELS[model_name], {input_name: images[0]})
    return images, float_model, input_name, prepared, names


def _collector(prepared, names, method: str):
    from quark_onnx.calibration.collector import Collector
    from quark_onnx.config.enums import coerce_calibrate_method
    from quark_onnx.config.options import ExtraOptions

    return Collector(
        prepared, names, method=coerce_calibrate_method(method), options=ExtraOptions()
    )


def child_timing(model_name: str, num_samples: int, methods: list[str], repeats: int) -> dict:
    """Float and calibration time per sample, ``repeats`` interleaved rounds, in one process."""
    import numpy as np
    import onnxruntime as ort

    from quark_onnx.calibration import session_options

    images, float_model, input_name, prepared, names = _setup(model_name)
    float_session = ort.InferenceSession(
        float_model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
    )
    collectors = {m: _collector(prepared, names, m) for m in methods}
    batch = next(iter(collectors.values())).max_batch if collectors else 1
    dynamic = next(iter(collectors.values())).combine if collectors else False
    batch = batch if dynamic else 1

    def float_per_sample() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        for first in range(0, num_samples, batch):
            rows = [images[i % len(images)] for i in range(first, min(first + batch, num_samples))]
            float_session.run(None, {input_name: np.concatenate(rows) if batch > 1 else rows[0]})
        return (
            (time.perf_counter() - wall) / num_samples * 1e3,
            (time.process_time() - cpu) / num_samples * 1e3,
        )

    float_per_sample()  # warm-up
    rounds = []
    for _ in range(repeats):
        row: dict = {}
        for method, collector in collectors.items():
            before = float_per_sample()
            wall, cpu = time.perf_counter(), time.process_time()
            collector.run(CyclingReader(images, num_samples, input_name), progress=False)
            wall = (time.perf_counter() - wall) / num_samples * 1e3
            cpu = (time.process_time() - cpu) / num_samples * 1e3
            after = float_per_sample()
            row[method] = {
                "calib_ms": wall,
                "calib_cpu_ms": cpu,
                "float_ms": (before[0] + after[0]) / 2,
                "float_cpu_ms": (before[1] + after[1]) / 2,
            }
        rounds.append(row)
    collector = next(iter(collectors.values()))
    return {
        "model": model_name,
        "samples": num_samples,
        "batch": batch,
        "tensors": len(names),
        "read_from_session": len(collector.sources),
        "rounds": rounds,
    }


def child_memory(model_name: str, num_samples: int, method: str) -> dict:
    """Peak RSS of one calibration in a fresh process, and the RSS before it started."""
    images, _, input_name, prepared, names = _setup(model_name)
    collector = _collector(prepared, names, method)
    before = _rss_mb()
    collector.run(CyclingReader(images, num_samples, input_name), progress=False)
    return {
        "model": model_name,
        "samples": num_samples,
        "method": method,
        "rss_before_mb": before,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }


def profile(model_name: str, num_samples: int, method: str) -> None:
    images, _, input_name, prepared, names = _setup(model_name)
    collector = _collector(prepared, names, method)
    collector.run(CyclingReader(images, num_samples, input_name), progress=False)


def _spawn(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="squeezenet")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--samples", default="100,1000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the numbers to this file")
    parser.add_argument("--profile", metavar="METHOD", help="run one calibration in-process")
    parser.add_argument("--child-timing", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-memory", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    methods = args.methods.split(",")
    samples = [int(s) for s in args.samples.split(",")]
    if args.profile:
        profile(args.model, samples[0], args.profile)
        return
    if args.child_timing:
        print(json.dumps(child_timing(args.model, args.child_timing, methods, args.repeats)))
        return
    if args.child_memory:
        print(json.dumps(child_memory(args.model, args.child_memory, methods[0])))
        return

    report: dict = {"model": args.model, "timing": [], "memory": []}
    if not args.no_timing:
        print(f"{args.model}: time per sample, median over {args.repeats} rounds")
        print(
            f"{'samples':>8} {'method':>12} {'calib ms':>9} {'float ms':>9} {'ratio':>6} "
            f"{'CPU ratio':>9}   wall ratio per round"
        )
        for n in samples:
            base = ["--model", args.model, "--methods", args.methods]
            r = _spawn([*base, "--repeats", str(args.repeats), "--child-timing", str(n)])
            report["timing"].append(r)
            for m in methods:
                cells = [row[m] for row in r["rounds"]]
                ratios = [c["calib_ms"] / c["float_ms"] for c in cells]
                cpu_ratios = [c["calib_cpu_ms"] / c["float_cpu_ms"] for c in cells]
                calib = statistics.median(c["calib_ms"] for c in cells)
                flt = statistics.median(c["float_ms"] for c in cells)
                print(
                    f"{n:>8} {m:>12} {calib:>9.2f} {flt:>9.2f} {statistics.median(ratios):>6.2f} "
                    f"{statistics.median(cpu_ratios):>9.2f}   "
                    + ", ".join(f"{x:.2f}" for x in ratios)
                )
        first = report["timing"][0]
        print(
            f"({first['tensors']} tensors calibrated, {first['read_from_session']} read from "
            f"the session, batch {first['batch']})"
        )
    if not args.no_memory:
        print(f"{args.model}: peak RSS of one calibration in a fresh process (MB)")
        print(f"{'method':>12} " + " ".join(f"{f'{n} samples':>22}" for n in samples) + "  growth")
        for m in methods:
            rows = [
                _spawn(["--model", args.model, "--methods", m, "--child-memory", str(n)])
                for n in samples
            ]
            report["memory"].extend(rows)
            cells = " ".join(
                f"{r['peak_rss_mb']:>9.1f} (+{r['peak_rss_mb'] - r['rss_before_mb']:>6.1f} cal)"
                for r in rows
            )
            growth = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"] - 1.0
            print(f"{m:>12} {cells}  {growth * 100:+.1f} %")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
