"""What each quantizer stage and each prepare pass costs, in time and peak memory, by model size.

Run from the repository root::

    python benchmarks/bench_stage_cost.py                     # every case below
    python benchmarks/bench_stage_cost.py --cases seg512x896,seg512x896_no_ers
    python benchmarks/bench_stage_cost.py --name stage_cost   # also writes results/stage_cost.*
    python benchmarks/bench_stage_cost.py --cases seg512x896,seg640 --peers ort,quark --repeat 3

Cases (the synthetic models are built here with ``onnx.helper`` from a fixed seed; samples are
seeded normal noise generated one at a time, so the reader holds none of them):

* ``seg512x896``: a segmenter with a 1x3x512x896 input, two residual streams (16 channels at
  1/2 resolution, 32 at 1/4, three blocks each, one channel of each stream 32x wider than the
  rest), a 4-class head resized back to 512x896; 64 samples. ``seg512x896_no_ers``: the same
  with ``EqualizeResidualStreams`` off (the acceptance compares the two: whole run at most 2x
  the time and at most 2.5 GB with the pass on).
* ``big1024``: the same architecture on a 1x3x1024x1024 input, 16 samples.
* ``seg640``: the same architecture on a 1x3x640x640 input, 32 samples: a 640x640 dense-prediction
  model with depthwise layers and residual streams, the size of a mobile detector.
* ``cls224``: a 224x224 classifier of the same blocks ending in GlobalAveragePool and Gemm,
  100 samples.
* ``wide1000``: two convolutions at full resolution on a 1x3x1000x1000 input, so the graph
  output is 1x16x1000x1000 (64 MB a sample); 16 samples: what the fidelity verdict holds as the
  output grows (issue 40 measured 1.13 GB with 4 samples).
* ``squeezenet1.1``, ``mobilenetv2``: the shared models (``$QUARK_ONNX_SHARED/models``, default
  ``../shared/models``), 100 samples of noise (the cost does not depend on what the images show).

Every case runs the XINT8 preset in a fresh interpreter (its ``ru_maxrss`` is its own). A thread
reads the resident set every 3 ms and keeps the maximum per stage (as ``bench_stage_memory.py``
does); the stage times and each prepare pass's time come from the quantizer's report. Printed
per case: the float model's nodes, activation elements per sample (the sum of every tensor's
elements, from shape inference) and samples, then one row per stage and per pass that took at
least 0.05 s. Linux only. A measurement, not a test: the machine is shared, compare within a run.

``--peers``: after each case, the same model and samples quantized by a peer in a fresh
interpreter, timed from its quantize call to its output file, so every round pairs this
quantizer with each peer: ``ort`` is onnxruntime's ``quantize_static`` (QDQ, MinMax, per-channel
int8 weights, uint8 activations; this interpreter's onnxruntime), ``quark`` is AMD Quark's XINT8
with the Vitis AI documentation's options (``benchmarks/.envs/quark``, made by
``benchmarks/peers/setup_envs.sh``; skipped with a note when absent). The table gives each
peer's median time and the median over rounds of this quantizer's time over the peer's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCRIPT = str(Path(__file__).resolve())
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SHARED = Path(os.environ.get("QUARK_ONNX_SHARED", ROOT.parent / "shared")).resolve() / "models"

#: case -> (builder or shared file, input height, width, samples, extra options)
CASES: dict[str, tuple[str, int, int, int, dict]] = {
    "seg512x896": ("segmenter", 512, 896, 64, {}),
    "seg512x896_no_ers": ("segmenter", 512, 896, 64, {"EqualizeResidualStreams": False}),
    "big1024": ("segmenter", 1024, 1024, 16, {}),
    "seg640": ("segmenter", 640, 640, 32, {}),
    "cls224": ("classifier", 224, 224, 100, {}),
    "wide1000": ("wide", 1000, 1000, 16, {}),
    "squeezenet1.1": ("squeezenet1.1.onnx", 224, 224, 100, {}),
    "mobilenetv2": ("mobilenetv2_rebuilt.onnx", 224, 224, 100, {}),
}


def build_model(kind: str, height: int, width: int, path: Path) -> None:
    """Write the synthetic ``segmenter`` or ``classifier`` (module doc) to ``path``."""
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes: list = []
    inits: list = []

    def conv(x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1) -> str:
        i = len(nodes)
        fan = cin // group * k * k
        w = rng.standard_normal((cout, cin // group, k, k)) * np.sqrt(2.0 / fan)
        inits.append(onnx.numpy_helper.from_array(w.astype(np.float32), f"w{i}"))
        b = rng.standard_normal(cout) * 0.05
        inits.append(onnx.numpy_helper.from_array(b.astype(np.float32), f"b{i}"))
        p = k // 2
        nodes.append(
            helper.make_node(
                "Conv",
                [x, f"w{i}", f"b{i}"],
                [f"conv{i}"],
                name=f"conv{i}",
                kernel_shape=[k, k],
                strides=[stride, stride],
                pads=[p, p, p, p],
                group=group,
            )
        )
        return f"conv{i}"

    def op(kind_: str, inputs: list[str], **attrs: object) -> str:
        name = f"{kind_.lower()}{len(nodes)}"
        nodes.append(helper.make_node(kind_, inputs, [name], name=name, **attrs))
        return name

    def stream(x: str, cin: int, c: int, stride: int) -> str:
        # the writer: no activation after it, one channel 32x wider (a range the stream carries)
        s = conv(x, cin, c, 3, stride)
        w = onnx.numpy_helper.to_array(inits[-2]).copy()
        w[0] *= 32.0
        inits[-2] = onnx.numpy_helper.from_array(w, inits[-2].name)
        for _ in range(3):
            h = op("Relu", [conv(s, c, 2 * c, 1)])
            h = op("Relu", [conv(h, 2 * c, 2 * c, 3, group=2 * c)])
            s = op("Add", [s, conv(h, 2 * c, c, 1)])
        return s

    x = "x"
    if kind == "wide":  # two layers at full resolution: a 1x16xHxW output
        y = conv(op("Relu", [conv(x, 3, 16, 3)]), 16, 16, 1)
        shape = [1, 16, height, width]
    else:
        s = stream(x, 3, 16, 2)
        s = stream(s, 16, 32, 2)
    if kind == "wide":
        pass
    elif kind == "segmenter":
        y = conv(op("Relu", [conv(s, 32, 32, 3)]), 32, 4, 1)
        scales = helper.make_tensor("up", TensorProto.FLOAT, [4], [1, 1, 4, 4])
        inits.append(scales)
        y = op("Resize", [y, "", "up"], mode="linear")
        shape = [1, 4, height, width]
    else:
        y = op("GlobalAveragePool", [op("Relu", [conv(s, 32, 64, 1)])])
        y = op("Flatten", [y])
        w = rng.standard_normal((10, 64)) * 0.1
        inits.append(onnx.numpy_helper.from_array(w.astype(np.float32), "fc_w"))
        inits.append(onnx.numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"))
        y = op("Gemm", [y, "fc_w", "fc_b"], transB=1)
        shape = [1, 10]
    graph = helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    # with the intermediate shapes, as exporters write them (the passes read the channels there)
    onnx.save(onnx.shape_inference.infer_shapes(model), str(path))


class NoiseReader:
    """``count`` seeded normal samples of one input, generated when asked (none held)."""

    def __init__(self, name: str, shape: tuple[int, ...], count: int) -> None:
        self.name, self.shape, self.count, self.index = name, shape, count, 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self.index >= self.count:
            return None
        rng = np.random.default_rng(self.index)
        self.index += 1
        return {self.name: rng.standard_normal(self.shape).astype(np.float32)}


def activation_elements(path: Path) -> int:
    """Elements of every tensor of the float model for one sample (shape inference; a tensor
    without a shape is not counted)."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    total = 0
    for info in (*model.graph.input, *model.graph.value_info, *model.graph.output):
        # a named dimension (the batch of a dynamic-batch model) counts as 1
        dims = [d.dim_value or 1 for d in info.type.tensor_type.shape.dim]
        if dims:
            total += int(np.prod(dims))
    return total


def _float_pass(path: Path, reader: NoiseReader) -> float:
    """Seconds of one onnxruntime run of the float model over the samples (default session
    options, the graph's outputs only): the unit of the calibration's cost."""
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    seconds = 0.0
    while (feed := reader.get_next()) is not None:  # generating a sample is not timed
        start = time.perf_counter()
        session.run(None, feed)
        seconds += time.perf_counter() - start
    return seconds


def run_case(name: str) -> dict:
    """Quantize case ``name`` in this process (the child side); what it measured."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_stage_memory import StageSampler, _label_stages

    sampler = StageSampler()
    import onnx

    from quark_onnx import Config, ModelQuantizer, get_default_config

    extra = CASES[name][4]
    with tempfile.TemporaryDirectory() as tmp:
        path, input_name, dims, samples = _case_model(name, tmp)
        nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
        elements = activation_elements(path)
        _label_stages(sampler, trim=False)
        qc = get_default_config("XINT8")
        qc.extra_options.update(extra)
        quantizer = ModelQuantizer(Config(global_quant_config=qc))
        start = time.perf_counter()
        quantizer.quantize_model(
            str(path),
            Path(tmp) / "out.onnx",
            NoiseReader(input_name, dims, samples),
            progress=False,
        )
        seconds = time.perf_counter() - start
        sampler.mark("float pass")
        float_pass = _float_pass(path, NoiseReader(input_name, dims, samples))
    sampler.mark("end")
    report = quantizer.report
    return {
        "case": name,
        "nodes": nodes,
        "activation_elements": elements,
        "samples": samples,
        "seconds": round(seconds, 2),
        "float_pass_seconds": round(float_pass, 2),
        "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "stages": {
            stage: {
                "seconds": report.timings.get(stage),
                "peak_mb": round(sampler.peaks.get(stage, 0.0)),
            }
            for stage in report.timings
        },
        "passes": {
            p["name"]: round(p["seconds"], 3) for p in report.passes if p["seconds"] >= 0.05
        },
        "modified_passes": [p["name"] for p in report.passes if p["modified"]],
        # bias correction replays fewer samples past its activation budget
        "bias_correction_samples": [
            (report.bias_correction or {}).get(key) for key in ("samples", "samples_available")
        ],
    }


PEER_NAMES = {"ort": "onnxruntime quantize_static", "quark": "AMD Quark XINT8"}
PEER_ENVS = {"ort": None, "quark": ROOT / "benchmarks" / ".envs" / "quark" / "bin" / "python"}


def _case_model(name: str, tmp: str) -> tuple[Path, str, tuple[int, ...], int]:
    """The case's model file (built into ``tmp`` when synthetic), its input and samples."""
    import onnx

    source, height, width, samples, _ = CASES[name]
    if source.endswith(".onnx"):
        path = SHARED / source
    else:
        path = Path(tmp) / "model.onnx"
        build_model(source, height, width, path)
    inp = onnx.load(str(path), load_external_data=False).graph.input[0]
    dims = tuple(d.dim_value or 1 for d in inp.type.tensor_type.shape.dim)
    return path, inp.name, dims, samples


def run_peer(peer: str, name: str) -> dict:
    """Quantize case ``name`` with ``peer`` in this process (the child side): its seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        path, input_name, dims, samples = _case_model(name, tmp)
        reader = NoiseReader(input_name, dims, samples)
        out = str(Path(tmp) / "peer.onnx")
        if peer == "ort":
            from onnxruntime.quantization import (
                CalibrationMethod,
                QuantFormat,
                QuantType,
                quantize_static,
            )

            def run() -> None:
                quantize_static(str(path), out, reader, quant_format=QuantFormat.QDQ,
                                per_channel=True, activation_type=QuantType.QUInt8,
                                weight_type=QuantType.QInt8,
                                calibrate_method=CalibrationMethod.MinMax)  # fmt: skip
        else:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            import common
            from onnxruntime.quantization.quant_utils import QuantType
            from quark.onnx import ModelQuantizer
            from quark.onnx.quantization.config.config import Config
            from quark.onnx.quantization.config.custom_config import get_default_config

            qc = get_default_config("XINT8")
            qc.activation_type = QuantType.QInt8
            qc.optimize_model = False
            qc.extra_options.update(common.XINT8_EXTRA_OPTIONS)

            def run() -> None:
                ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
                    str(path), out, reader
                )

        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return {"peer": peer, "case": name, "seconds": round(seconds, 2), "peak_mb": peak}


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        lines.append(
            f"{row['case']}: {row['nodes']} nodes, {row['activation_elements'] / 1e6:.1f} M "
            f"activation elements per sample, {row['samples']} samples: "
            f"{row['seconds']:.1f} s, process peak {row['peak_mb']} MB; one float pass over the "
            f"samples {row['float_pass_seconds']:.1f} s (calibrate "
            f"{row['stages']['calibrate']['seconds'] / row['float_pass_seconds']:.2f}x it)"
        )
        lines.append(f"  {'stage / pass':34s} {'seconds':>8s} {'peak MB':>8s}")
        for stage, cost in row["stages"].items():
            lines.append(f"  {stage:34s} {cost['seconds']:8.2f} {cost['peak_mb']:8d}")
            replayed, kept = row.get("bias_correction_samples") or (None, None)
            if stage == "bias_correction" and replayed is not None and kept is not None:
                lines.append(f"    samples replayed: {replayed} of {kept}")
            if stage == "prepare":
                for pass_, seconds in row["passes"].items():
                    lines.append(f"    {pass_:32s} {seconds:8.2f}")
        for peer, cost in row.get("peers", {}).items():
            lines.append(
                f"  peer {PEER_NAMES[peer]}: {cost['seconds']:.1f} s, peak {cost['peak_mb']} MB; "
                f"this quantizer / it: {cost['ratio']:.2f}x (median of {cost['rounds']} paired "
                "rounds)"
            )
    by_case = {row["case"]: row for row in rows}
    on, off = by_case.get("seg512x896"), by_case.get("seg512x896_no_ers")
    if on and off:
        ratio = on["seconds"] / off["seconds"]
        lines.append(
            f"seg512x896 with EqualizeResidualStreams / without: time {ratio:.2f}x (target <= 2),"
            f" peak {on['peak_mb']} MB (target <= 2560)"
        )
    return "\n".join(lines)


def _child(command: list[str], label: str) -> dict | None:
    """The JSON the child ``command`` prints last, or None (its error printed) when it fails.
    It runs in a temporary folder: a peer may write files into its working folder (Quark
    writes ``quantized_info.csv``)."""
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(command, capture_output=True, text=True, cwd=cwd)
    if out.returncode != 0:
        print(f"{label}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeat", type=int, default=1, help="runs per case, cases alternating")
    parser.add_argument("--name", help="write benchmarks/results/NAME.{txt,json}")
    parser.add_argument("--peers", default="", help="comma separated: ort, quark (module doc)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--peer-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child)))
        return 0
    if args.peer_child:
        print(json.dumps(run_peer(*args.peer_child)))
        return 0
    names = args.cases.split(",")
    for name in names:
        if name not in CASES:
            parser.error(f"unknown case {name!r}; cases: {', '.join(CASES)}")
    peers = []
    for peer in filter(None, args.peers.split(",")):
        if peer not in PEER_ENVS:
            parser.error(f"unknown peer {peer!r}; peers: {', '.join(PEER_ENVS)}")
        env = PEER_ENVS[peer]
        if env is not None and not env.exists():
            print(f"peer {peer}: {env} does not exist (benchmarks/peers/setup_envs.sh): skipped")
        else:
            peers.append(peer)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    peer_runs: dict[tuple[str, str], list[tuple[float, dict]]] = {}
    for _ in range(args.repeat):
        for name in names:  # alternating: a change of the machine's load hits every case
            ours = _child([sys.executable, SCRIPT, "--child", name], name)
            if ours is None:
                continue
            runs[name].append(ours)
            print(table(runs[name][-1:]), flush=True)
            for peer in peers:
                python = str(PEER_ENVS[peer] or sys.executable)
                theirs = _child([python, SCRIPT, "--peer-child", peer, name], f"{name} {peer}")
                if theirs is not None:  # paired: this round's own time over the peer's
                    peer_runs.setdefault((name, peer), []).append(
                        (ours["seconds"] / theirs["seconds"], theirs)
                    )
    # per case the run of median time (the lower middle one of an even count)
    rows = [
        sorted(r, key=lambda row: row["seconds"])[(len(r) - 1) // 2] for r in runs.values() if r
    ]
    for row in rows:
        row["all_seconds"] = [r["seconds"] for r in runs[row["case"]]]
        for peer in peers:
            pairs = sorted(peer_runs.get((row["case"], peer), []), key=lambda pair: pair[0])
            if pairs:
                ratio, theirs = pairs[(len(pairs) - 1) // 2]
                row.setdefault("peers", {})[peer] = {
                    "seconds": theirs["seconds"],
                    "peak_mb": theirs["peak_mb"],
                    "ratio": round(ratio, 3),
                    "rounds": len(pairs),
                }
    text = table(rows)
    if args.name:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        command = "python benchmarks/bench_stage_cost.py " + " ".join(argv or sys.argv[1:])
        header = f"command: {command} at commit {commit}\n"
        (RESULTS / f"{args.name}.txt").write_text(header + text + "\n")
        (RESULTS / f"{args.name}.json").write_text(
            json.dumps({"command": command, "commit": commit, "rows": rows}, indent=1) + "\n"
        )
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
