"""How much can per-tensor int8 keep of a model at all? XINT8 against float-scale int8.

Run from the repository root (project environment)::

    python benchmarks/bench_int8_bound.py --models ppocr,person
    python benchmarks/bench_int8_bound.py --models squeezenet --images 500

Each model is quantized twice, with ``bench_fidelity``'s data and metrics:

* ``xint8``: the XINT8 preset as shipped (power-of-two scales, the NPU's shift and
  shared-position rules, bias correction);
* ``float_int8``: the same preset with ``enable_npu_cnn = False`` and ``calibrate_method = MSE``:
  signed symmetric int8, per-tensor weights and activations as the NPU has them, but any float
  scale chosen by the output MSE of each tensor and no NPU rule (no power of two, no shared
  positions, no shift limits). Bias correction is off (it needs power-of-two scales).

Each result is then split as ``bench_error_sources`` does: ``weights only`` (every activation
Q/DQ pair removed) and ``activations only`` (every weight and bias replaced by the prepared
float model's). ``float_int8``'s ``activations only`` row answers: with float weights and an
unconstrained per-tensor scale for every activation, what does int8 per-tensor activation
quantization alone leave of the model's output? Each scale is its own tensor's MSE choice and the
NPU passes do not run, so it is not a bound for every model (SqueezeNet's XINT8 activations measure
above it: its global mean becomes a Conv with its own position; ``results/int8_bound.md``).

``--extra-bits 1,2,3`` adds rows for ``xint8`` with every activation quantized at ``8 + k`` bits
at the same power-of-two range (step ``s / 2^k``, clipped to ``[-128 s, 127 s]``, the
QuantizeLinear/DequantizeLinear pair written as ``Mul``, ``Round``, ``Clip``, ``Mul``; weights
as quantized, or float in the ``activations only`` row): how many bits per activation a
fidelity target asks for at the positions XINT8 chose.

Results go to ``benchmarks/results/<--name>.txt`` (default ``int8_bound``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_accuracy
import bench_error_sources
import bench_fidelity
import common


def float_int8(qc) -> None:
    """Per-tensor symmetric int8 with free float scales: the NPU's format without its rules."""
    from quark_onnx.config.enums import CalibrationMethod

    qc.enable_npu_cnn = False
    qc.calibrate_method = CalibrationMethod.MSE
    qc.include_bias_correction = False


OPTION_SETS = {"xint8": None, "float_int8": float_int8}


def finer_activations(model: onnx.ModelProto, extra_bits: int) -> onnx.ModelProto:
    """``model`` with each activation Q/DQ pair at ``8 + extra_bits`` bits, same range."""
    from onnx import helper, numpy_helper

    model = bench_error_sources._copy(model)
    constants = {i.name: i for i in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    fine = 2.0**extra_bits
    nodes, added = [], []
    for node in model.graph.node:
        q = producer.get(node.input[0]) if node.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or q.input[0] in constants:
            nodes.append(node)
            continue
        scale = float(numpy_helper.to_array(constants[q.input[1]]).reshape(()))
        zero = float(numpy_helper.to_array(constants[q.input[2]]).reshape(())) if q.input[2:] else 0
        if zero != 0.0:
            raise ValueError(f"{q.name}: zero point {zero}; the counterfactual is for XINT8")
        out = node.output[0]
        values = {
            "inv": np.float32(fine / scale),
            "lo": np.float32(-128 * fine),
            "hi": np.float32(127 * fine),
            "step": np.float32(scale / fine),
        }
        for key, value in values.items():
            added.append(numpy_helper.from_array(np.array(value), f"{out}_fine_{key}"))
        nodes += [
            helper.make_node("Mul", [q.input[0], f"{out}_fine_inv"], [f"{out}_fine_x"]),
            helper.make_node("Round", [f"{out}_fine_x"], [f"{out}_fine_r"]),
            helper.make_node(
                "Clip", [f"{out}_fine_r", f"{out}_fine_lo", f"{out}_fine_hi"], [f"{out}_fine_c"]
            ),
            helper.make_node("Mul", [f"{out}_fine_c", f"{out}_fine_step"], [out]),
        ]
    read = {x for n in nodes for x in n.input} | {o.name for o in model.graph.output}
    nodes = [n for n in nodes if n.op_type != "QuantizeLinear" or n.output[0] in read]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(added)
    return model


def measure(name: str, images: int | None, work: Path, extra_bits: list[int]) -> list[str]:
    entry = bench_fidelity.load_entry(name)
    if images:
        labels = None if entry.labels is None else entry.labels[:images]
        entry = dataclasses.replace(entry, test=entry.test[:images], labels=labels)
    original = Path(bench_accuracy.MODELS.get(entry.base, entry.float_path))
    f_out = bench_fidelity.run_all(original, entry.test)
    top1 = None
    if entry.labels is not None:
        first = next(iter(f_out.values())).reshape(len(entry.test), -1)
        top1 = float(np.mean(first.argmax(axis=1) == entry.labels))
    input_name = onnx.load(str(entry.float_path), load_external_data=False).graph.input[0].name
    lines = []
    for label, tweak in OPTION_SETS.items():
        path = work / f"{name}_{label}.onnx"
        bench_fidelity.quantize(entry, bench_fidelity.make_config("preset", tweak), path)
        quantized = onnx.load(str(path))
        prepared = bench_error_sources.prepared_float(
            entry, bench_fidelity.make_config("preset", tweak), input_name
        )
        splits = {
            "quantized": quantized,
            "weights only": bench_error_sources.float_activations(quantized),
            "activations only": bench_error_sources.float_constants(quantized, prepared),
        }
        for k in extra_bits if tweak is None else []:
            splits[f"{8 + k}-bit activations"] = finer_activations(quantized, k)
            splits[f"{8 + k}-bit act. only"] = finer_activations(splits["activations only"], k)
        for split, model in splits.items():
            split_path = work / f"{name}_{label}_{split.replace(' ', '_')}.onnx"
            onnx.save(model, str(split_path))
            row = bench_fidelity.evaluate(entry, f_out, split_path, top1)
            det = (row.get("detection") or {}).get("match_rate")
            line = (
                f"{name:12s} {label:11s} {split:20s} SQNR {row['min_sqnr_db']:6.2f} dB"
                f"  agree {_fmt(row.get('agreement'), '.3f')}"
                f"  drop {_fmt(row.get('drop_points'), '.2f')}  det {_fmt(det, '.3f')}"
            )
            print(line, flush=True)
            lines.append(line)
    return lines


def _fmt(value: float | None, spec: str) -> str:
    return "-".rjust(6) if value is None else format(value, spec).rjust(6)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="ppocr,person,squeezenet")
    parser.add_argument("--images", type=int, default=None, help="first N test images only")
    parser.add_argument(
        "--extra-bits", default="", help="e.g. 1,2,3: xint8 rows with 8+k-bit activations"
    )
    parser.add_argument("--name", default="int8_bound")
    args = parser.parse_args(argv)
    info = common.machine_info()
    head = (
        f"bench_int8_bound.py {' '.join(sys.argv[1:])}: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {info.get('cpu', '')}, "
        f"{info.get('cores', '')} cores, quark_onnx {bench_fidelity._git_commit()}\n"
        "SQNR of the first output against the ORIGINAL float model on the test images; agree = "
        "argmax agreement; drop = top-1 points; det = share of float detections matched\n"
    )
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="int8_bound_") as tmp:
        for name in args.models.split(","):
            extra = [int(k) for k in args.extra_bits.split(",") if k]
            lines += measure(name, args.images, Path(tmp), extra)
    out = common.RESULTS_DIR / f"{args.name}.txt"
    bench_fidelity._atomic_text(out, head + "\n".join(lines) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
