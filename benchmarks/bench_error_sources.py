"""Where does a quantized model lose its float behaviour: weights, activations, or one group?

Run from the repository root (project environment)::

    python benchmarks/bench_error_sources.py --model person --config preset
    python benchmarks/bench_error_sources.py --model ppocr --config seed --images 200
    python benchmarks/bench_error_sources.py --model person --off EqualizeGatedActivations

The model is quantized as ``bench_fidelity.py`` does (same data, same option sets), then run on
the first ``--images`` test images in variants of the quantized graph, each compared with the
original float model by ``bench_fidelity``'s metrics (output SQNR, cosine, detection match or
argmax agreement):

* ``quantized``: as written;
* ``weights only``: every activation Q/DQ pair removed (weights and bias stay quantized, with
  what bias correction did to them): the loss of the weights;
* ``activations only``: every weight and bias replaced by the prepared float model's (the model
  after the prepare passes, run here with the same options and samples): the loss of the
  activations;
* ``float <group>``: the activation Q/DQ pairs of the tensors whose names contain one of the
  ``--group`` substrings removed (e.g. a detector head's Concat inputs and outputs): what the
  NPU rules on that group cost.

``--off NAME`` turns a boolean extra option (or ``include_*`` field) of the option set off
(repeatable), to see what a technique changes in the split.

``--rank N``: one variant per quantized activation with only that tensor's Q/DQ pair removed,
ranked by the output SQNR gained (the N largest printed), each with the tensor's own
quantization SQNR at its position (over the same images, given the quantized tensors before
it). It tells a loss concentrated in a few tensors (a clip, a forced shared position) from one
spread over the whole network (no tensor gains much).

The variants change Q/DQ pairs only; nothing is re-calibrated. Results are printed and appended
to ``benchmarks/results/<--name>.txt`` (default ``error_sources``; rewritten atomically).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from quark_onnx.model_files.load import load_ir

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fidelity
import common


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _rewire(model: onnx.ModelProto, rename: dict[str, str], drop: set[str]) -> None:
    """Drop the nodes named in ``drop``; inputs and graph outputs read through ``rename``."""
    graph = model.graph
    kept = [n for n in graph.node if n.name not in drop]
    for node in kept:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    outputs = {o.name for o in graph.output}
    # a graph output produced by a removed DequantizeLinear keeps its name through an Identity
    extra = [
        onnx.helper.make_node("Identity", [src], [dst], name=f"{dst}_float")
        for dst, src in rename.items()
        if dst in outputs
    ]
    nodes = [onnx.NodeProto.FromString(n.SerializeToString()) for n in kept + extra]
    del graph.node[:]
    graph.node.extend(nodes)


def float_activations(model: onnx.ModelProto, keep_float=lambda name: True) -> onnx.ModelProto:
    """``model`` without the activation Q/DQ pairs whose float tensor ``keep_float`` selects."""
    model = _copy(model)
    constants = {i.name for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    rename: dict[str, str] = {}
    drop: set[str] = set()
    for node in model.graph.node:
        if node.op_type != "DequantizeLinear" or node.input[0] in constants:
            continue
        q = producer.get(node.input[0])
        if q is None or q.op_type != "QuantizeLinear" or q.input[0] in constants:
            continue
        if keep_float(q.input[0]):
            rename[node.output[0]] = q.input[0]
            drop.add(node.name)
    # a QuantizeLinear whose every reader went goes too
    readers: dict[str, list[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.name)
    for node in model.graph.node:
        if node.op_type == "QuantizeLinear" and all(
            r in drop for r in readers.get(node.output[0], [])
        ):
            drop.add(node.name)
    _rewire(model, rename, drop)
    return model


def float_constants(model: onnx.ModelProto, prepared: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each quantized constant (``<name>_quantized`` through a DequantizeLinear)
    replaced by the prepared float model's ``<name>``."""
    model = _copy(model)
    floats = {i.name: i for i in prepared.graph.initializer}
    rename: dict[str, str] = {}
    drop: set[str] = set()
    added = []
    for node in model.graph.node:
        source = node.input[0] if node.op_type == "DequantizeLinear" else ""
        base = source.removesuffix("_quantized")
        if source.endswith("_quantized") and base in floats:
            tensor = onnx.TensorProto()
            tensor.CopyFrom(floats[base])
            tensor.name = f"{base}_float"
            added.append(tensor)
            rename[node.output[0]] = tensor.name
            drop.add(node.name)
    _rewire(model, rename, drop)
    model.graph.initializer.extend(added)
    return model


def prepared_float(entry: bench_fidelity.Entry, qc, input_name: str) -> onnx.ModelProto:
    """The float model after the prepare passes, as the quantizer runs them (same samples)."""
    import onnx_ir as ir

    from quark_onnx.pipeline.prepare import RANGE_SAMPLES, quantize_passes, run_passes

    options = qc.validate()
    samples = [{input_name: entry.calib[i : i + 1]} for i in range(min(16, len(entry.calib)))]
    model = load_ir(str(entry.float_path))
    passes = quantize_passes(qc, options, samples[0], samples[:RANGE_SAMPLES])
    run_passes(model, passes, sample_feeds=samples, revert_costly=options.RevertCostlyPasses)
    return ir.to_proto(model)


def measure(entry: bench_fidelity.Entry, f_out: dict, model: onnx.ModelProto) -> dict:
    q_out = bench_fidelity.run_all(model, entry.test[: len(next(iter(f_out.values())))])
    name = next(iter(f_out))
    row = bench_fidelity.output_fidelity(f_out[name], q_out[name])
    if entry.task == "detector":
        row["detection"] = bench_fidelity.detection_match(f_out[name], q_out[name])
    else:
        f, q = (a.reshape(len(a), -1).argmax(axis=1) for a in (f_out[name], q_out[name]))
        row["agreement"] = round(float(np.mean(f == q)), 4)
    return row


def activation_pairs(model: onnx.ModelProto) -> list[tuple[str, float]]:
    """(float tensor, scale) of every activation QuantizeLinear with a constant scale."""
    from onnx import numpy_helper

    constants = {i.name: i for i in model.graph.initializer}
    pairs = []
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in constants:
            continue
        scale = constants.get(node.input[1])
        if scale is not None and node.input[0] not in dict(pairs):
            pairs.append((node.input[0], float(numpy_helper.to_array(scale).reshape(()))))
    return pairs


def own_sqnr(model: onnx.ModelProto, x: np.ndarray, pairs: list[tuple[str, float]]) -> dict:
    """Each tensor's own quantization SQNR (dB): ``clip(rint(t / s), -128, 127) * s`` against
    ``t`` as the quantized model computes it, summed over the images ``x``."""
    import onnxruntime as ort

    probe = _copy(model)
    outputs = {o.name for o in probe.graph.output}
    for name, _ in pairs:
        if name not in outputs:
            probe.graph.output.append(onnx.helper.make_value_info(name, onnx.TypeProto()))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    names = [name for name, _ in pairs]
    power = dict.fromkeys(names, 0.0)
    noise = dict.fromkeys(names, 0.0)
    for i in range(len(x)):
        results = session.run(names, {input_name: x[i : i + 1]})
        for (name, scale), t in zip(pairs, results, strict=True):
            t = t.astype(np.float64)
            q = np.clip(np.rint(t / scale), -128, 127) * scale
            power[name] += float(np.sum(t * t))
            noise[name] += float(np.sum((t - q) ** 2))
    return {n: 10 * np.log10(power[n] / noise[n]) if noise[n] > 0 else float("inf") for n in names}


def rank_tensors(entry, f_out: dict, quantized: onnx.ModelProto, top: int) -> list[str]:
    """Lines: the ``top`` activations whose Q/DQ removal raises output SQNR most."""
    base = measure(entry, f_out, quantized)
    pairs = activation_pairs(quantized)
    x = entry.test[: len(next(iter(f_out.values())))]
    own = own_sqnr(quantized, x, pairs)
    gains = []
    for name, scale in pairs:
        row = measure(entry, f_out, float_activations(quantized, lambda t, n=name: t == n))
        gains.append((row["sqnr_db"] - base["sqnr_db"], name, scale))
    gains.sort(key=lambda g: (-g[0], g[1]))
    positive = sum(g[0] for g in gains if g[0] > 0)
    lines = [
        f"  rank: {len(pairs)} activations; output SQNR gained by removing one tensor's Q/DQ "
        f"(sum of the positive gains {positive:.2f} dB):"
    ]
    for gain, name, scale in gains[:top]:
        lines.append(
            f"    {gain:+6.2f} dB  {name:<44} p={int(-np.log2(scale)):3d}  "
            f"own SQNR {own[name]:6.2f} dB"
        )
    return lines


def _line(label: str, row: dict) -> str:
    det = row.get("detection")
    extra = (
        f"det {det['matched']}/{det['float_boxes']} = {det['match_rate']:.3f}"
        if det
        else f"agree {row.get('agreement')}"
    )
    return f"  {label:<34} SQNR {row['sqnr_db']:7.2f} dB  cos {row['cosine']:.4f}  {extra}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="person", help="a bench_fidelity model name")
    parser.add_argument("--config", default="preset", choices=bench_fidelity.CONFIGS)
    parser.add_argument("--images", type=int, default=200, help="first N test images")
    parser.add_argument(
        "--group",
        action="append",
        default=[],
        help="label=substr1,substr2: also measure with those activations float (repeatable)",
    )
    parser.add_argument("--off", action="append", default=[], help="option to turn off")
    parser.add_argument("--name", default="error_sources", help="results/<name>.txt")
    parser.add_argument(
        "--rank", type=int, default=0, help="also rank single tensors: print the N best"
    )
    args = parser.parse_args(argv)
    entry = bench_fidelity.load_entry(args.model)

    def config():
        qc = bench_fidelity.make_config(args.config)
        for name in args.off:
            if name.startswith("include_"):
                setattr(qc, name, False)
            else:
                qc.extra_options[name] = False
        return qc

    qc = config()
    tag = "".join(f".no-{name}" for name in args.off)
    out = bench_fidelity.WORK / "out" / f"{entry.name}.{args.config}{tag}.sources.onnx"
    bench_fidelity.quantize(entry, qc, out)
    quantized = onnx.load(str(out))
    input_name = quantized.graph.input[0].name
    prepared = prepared_float(entry, config(), input_name)
    f_out = bench_fidelity.run_all(entry.float_path, entry.test[: args.images])
    lines = [
        f"bench_error_sources.py {' '.join(sys.argv[1:] if argv is None else argv)}: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {entry.name}, {args.config}, "
        f"first {args.images} test images"
    ]
    variants = [
        ("quantized", quantized),
        ("weights only (activations float)", float_activations(quantized)),
        ("activations only (float weights)", float_constants(quantized, prepared)),
    ]
    for spec in args.group:
        label, _, subs = spec.partition("=")
        parts = [s for s in subs.split(",") if s]
        selected = float_activations(quantized, lambda n, p=parts: any(s in n for s in p))
        variants.append((f"float {label}", selected))
    for label, model in variants:
        lines.append(_line(label, measure(entry, f_out, model)))
        print(lines[-1], flush=True)
    if args.rank:
        for line in rank_tensors(entry, f_out, quantized, args.rank):
            lines.append(line)
            print(line, flush=True)
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = common.RESULTS_DIR / f"{args.name}.txt"
    old = path.read_text() if path.exists() else ""
    bench_fidelity._atomic_text(path, old + "\n".join(lines) + "\n\n")
    print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
