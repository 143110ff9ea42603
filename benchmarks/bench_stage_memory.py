"""Peak resident memory of each quantizer stage, for one model and one calibration array.

Run from the repository root::

    python benchmarks/bench_stage_memory.py --model mobilenetv2
    python benchmarks/bench_stage_memory.py --model path/to/model.onnx --calib path/to/calib.npy

    python benchmarks/bench_stage_memory.py --chain add:10000
    python benchmarks/bench_stage_memory.py --floor add:10000

``--model`` is a shared model name (digits_cnn, squeezenet1.1, mobilenetv2) or a path; the shared
names read the calibration arrays that ``bench_peers.py`` caches under ``benchmarks/.work/data``
(run it once first), a path needs ``--calib`` (a ``.npy`` of samples along axis 0).
``--chain KIND:N`` quantizes ``bench_scaling.py``'s chain of N Conv or Add nodes instead, as that
script does (2 random samples, ``optimize_model=False``): which stage holds what as graphs grow.

``--floor KIND:N`` measures what holding that chain costs, each part alone in a fresh
interpreter (resident set after a full collection and a heap trim, over the interpreter with
quark_onnx, onnx_ir and onnxruntime imported): the float and the XINT8 model as protobuf and as
onnx_ir graph, the XINT8 graph with its scale/zero-point initializers shared (one per distinct
value: what sharing them would save), and one onnxruntime session over the whole XINT8 graph and
over one piece of ``runtime.SEGMENT_NODES`` nodes.

A thread reads the resident set (``quark_onnx.runtime.memory.resident_mb``) every 3 ms and keeps the
maximum per label; the label is the quantizer stage running (``ModelQuantizer``'s stages: load,
prepare, plan, calibrate, positions, constraints, insert_qdq, bias_correction, finalize, check,
save) or ``after <stage>`` between stages. ``--trim`` also returns glibc's free pages after every
stage (as the quantizer does after its large stages only), so each stage starts from what is
really held.
The XINT8 preset is quantized unless ``--preset`` names another. Linux only. The whole-process
peak (``ru_maxrss``) is printed too: it is what ``bench_peers.py`` reports.

This is a measurement, not a test; numbers move by a few MB between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from quark_onnx.runtime.memory import resident_mb

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / ".work" / "data"
#: the benchmark models: $QUARK_ONNX_SHARED/models, else ../shared/models
SHARED = Path(os.environ.get("QUARK_ONNX_SHARED", ROOT.parent / "shared")).resolve() / "models"
SHARED_MODELS = {
    "digits_cnn": ("digits_cnn.onnx", "digits_cnn_calib.npy"),
    "squeezenet1.1": ("squeezenet1.1.onnx", "squeezenet1.1_calib.npy"),
    "mobilenetv2": ("mobilenetv2_rebuilt.onnx", "mobilenetv2_calib.npy"),
}


class StageSampler:
    """Maximum resident set per label, sampled by a daemon thread."""

    def __init__(self, period: float = 0.003) -> None:
        self.label = "imports"
        self.peaks: dict[str, float] = {}
        self._period = period
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            label, now = self.label, resident_mb()
            if now is not None:
                self.peaks[label] = max(self.peaks.get(label, 0.0), now)
            time.sleep(self._period)

    def mark(self, label: str) -> None:
        self.label = label
        time.sleep(2 * self._period)  # the label's first sample is taken before work starts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mobilenetv2")
    parser.add_argument("--calib", help="a .npy of calibration samples (axis 0)")
    parser.add_argument("--chain", metavar="KIND:N", help="a chain of N conv or add nodes")
    parser.add_argument("--floor", metavar="KIND:N", help="per-part memory of a chain (doc)")
    parser.add_argument("--preset", default="XINT8")
    parser.add_argument("--trim", action="store_true", help="trim the heap after every stage")
    args = parser.parse_args(argv)

    sampler = StageSampler()
    import onnx

    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

    if args.floor:
        return _floor(args.floor)
    if args.chain:
        return _chain(args, sampler)
    if args.model in SHARED_MODELS:
        model_file, calib_file = SHARED_MODELS[args.model]
        model_path, calib_path = SHARED / model_file, Path(args.calib or DATA / calib_file)
    else:
        if not args.calib:
            parser.error("--calib is needed with a model path")
        model_path, calib_path = Path(args.model), Path(args.calib)
    if not calib_path.exists():
        parser.error(f"{calib_path}: missing (python benchmarks/bench_peers.py caches it)")

    _label_stages(sampler, args.trim)
    sampler.mark("calibration array")
    samples = np.load(calib_path)
    input_name = onnx.load(str(model_path), load_external_data=False).graph.input[0].name
    reader = ArrayDataReader({input_name: samples}, batch_size=1)
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config(args.preset)))
    with tempfile.TemporaryDirectory() as tmp:
        quantizer.quantize_model(str(model_path), Path(tmp) / "out.onnx", reader)
    _print(sampler, quantizer, f"{model_path.name}, {args.preset}, {len(samples)} samples")
    return 0


def _label_stages(sampler: StageSampler, trim: bool) -> None:
    """Label the sampler with the quantizer stage running (and trim after each, if asked)."""
    import quark_onnx.pipeline.quantizer as quantizer_module
    from quark_onnx.runtime.memory import release_freed_memory

    original_stage = quantizer_module._stage

    @contextlib.contextmanager
    def labelled_stage(report, name: str) -> Iterator[None]:
        sampler.mark(name)
        with original_stage(report, name):
            yield
        if trim:
            release_freed_memory()
        sampler.mark(f"after {name}")

    quantizer_module._stage = labelled_stage


def _chain(args: argparse.Namespace, sampler: StageSampler) -> int:
    from bench_scaling import build_chain

    from quark_onnx import Config, ModelQuantizer, get_default_config

    kind, _, count = args.chain.partition(":")
    with tempfile.TemporaryDirectory() as tmp:
        sampler.mark("build")
        path = Path(tmp) / "chain.onnx"
        build_chain(kind, int(count), path)
        _label_stages(sampler, args.trim)
        qc = get_default_config(args.preset)
        qc.optimize_model = False
        qc.extra_options.update(UseRandomData=True, RandomDataSamples=2)
        quantizer = ModelQuantizer(Config(global_quant_config=qc))
        quantizer.quantize_model(path, Path(tmp) / "out.onnx", progress=False)
    _print(sampler, quantizer, f"{kind} chain of {count}, {args.preset}, 2 random samples")
    return 0


_FLOOR_CHILD = """
import gc, sys
import numpy as np, onnx, onnx_ir as ir, onnxruntime
from quark_onnx import runtime
from quark_onnx.runtime.memory import release_freed_memory, resident_mb

def held():
    gc.collect()
    release_freed_memory()
    return resident_mb()

part, path = sys.argv[1], sys.argv[2]
base = held()
proto = onnx.load(path)
if part.endswith("shared"):
    # one initializer per distinct scalar (dtype, bytes): the scales and zero points
    first, rename, keep = {}, {}, []
    for t in proto.graph.initializer:
        if not t.dims and t.name.endswith(("_scale", "_zero_point")):
            key = (t.data_type, t.raw_data or t.SerializeToString())
            if key in first:
                rename[t.name] = first[key]
                continue
            first[key] = t.name
        keep.append(t)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(keep)
    for node in proto.graph.node:
        for i, x in enumerate(node.input):
            if x in rename:
                node.input[i] = rename[x]
if part.startswith("proto"):
    obj = proto
elif part.startswith("ir"):
    obj = ir.serde.deserialize_model(proto)  # keeps the parsed tensors it wraps alive
elif part == "session":
    obj = runtime.create_session(proto)
elif part == "piece":
    graph = runtime._Graph(proto)
    (start, end), *_ = graph.cuts(runtime.SEGMENT_NODES)
    names = [o for w in graph.writes[start:end] for o in w]
    data = graph.segment_bytes(start, end, ["x"], names[-1:], {"x": np.zeros((1, 16), np.float32)})
    del graph
    obj = runtime.create_session(data)
    del data
del proto
print(base, held() - base)
"""


def _floor(spec: str) -> int:
    """Print the memory of each part of holding chain ``spec`` (module doc), in fresh processes."""
    import subprocess

    from bench_scaling import build_chain

    from quark_onnx import Config, ModelQuantizer, get_default_config

    kind, _, count = spec.partition(":")
    n = int(count)
    with tempfile.TemporaryDirectory() as tmp:
        float_path, quant_path = Path(tmp) / "chain.onnx", Path(tmp) / "q.onnx"
        build_chain(kind, n, float_path)
        qc = get_default_config("XINT8")
        qc.optimize_model = False
        qc.extra_options.update(UseRandomData=True, RandomDataSamples=2, FidelityCheck=False)
        ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
            float_path, quant_path, progress=False
        )
        print(f"{kind} chain of {n} (XINT8: {_nodes(quant_path)} nodes): MB held, KB per {kind}")
        for label, part, path in [
            ("float protobuf", "proto", float_path),
            ("float onnx_ir", "ir", float_path),
            ("XINT8 protobuf", "proto", quant_path),
            ("XINT8 onnx_ir", "ir", quant_path),
            ("XINT8 onnx_ir, scales shared", "ir shared", quant_path),
            ("XINT8 session, whole graph", "session", quant_path),
            ("XINT8 session, one piece", "piece", quant_path),
        ]:
            out = subprocess.run(
                [sys.executable, "-c", _FLOOR_CHILD, part, str(path)],
                capture_output=True,
                text=True,
                check=True,
            )
            base, mb = map(float, out.stdout.strip().splitlines()[-1].split())
            if label.startswith("float protobuf"):
                print(f"  {'interpreter and imports':32s} {base:7.0f} MB")
            print(f"  {label:32s} {mb:7.0f} MB {mb * 1024 / n:7.1f} KB")
    return 0


def _nodes(path: Path) -> int:
    import onnx

    return len(onnx.load(str(path)).graph.node)


def _print(sampler: StageSampler, quantizer: Any, title: str) -> None:
    sampler.mark("end")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{title}: process peak {peak:.0f} MB")
    print(f"  {'stage':28s} {'peak MB':>8s} {'seconds':>8s}")
    timings = quantizer.report.timings
    for label, value in sampler.peaks.items():
        seconds = timings.get(label)
        shown = f"{seconds:8.3f}" if seconds is not None else ""
        print(f"  {label:28s} {value:8.0f} {shown}")


if __name__ == "__main__":
    sys.exit(main())
