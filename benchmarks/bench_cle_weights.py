"""Per-layer weight statistics before and after cross-layer equalization (CLE).

For every convolution whose weights CLE rewrote, prints:

* ``spread``: ``max_c r_c / min_c r_c`` over the output channels (``r_c = max |W[c]|``);
* ``SQNR``: ``10 log10(sum w^2 / sum (w - Q(w))^2)`` of the whole tensor, ``Q`` = per-tensor int8
  power-of-two quantization (the NPU's weight format) at the NonOverflow position
  (:func:`quark_onnx.params.pof2.nonoverflow_position`: the finest ``s = 2^-p`` at which
  ``clip(round_half_even(w / s), -128, 127)`` does not saturate);
* ``chSQNR``: the mean over output channels of the same ratio taken per channel, which shows the
  narrow channels that a per-tensor scale rounds away.

and, end to end, the logits of the model whose Conv/Gemm/MatMul weights (only) are quantized that
way (NonOverflow, and MinMSE, XINT8's default weight method), against the float logits: SQNR in
dB, agreement of the top-1 class with the float model and, with labels, top-1 accuracy.
Variants: the model as given (ReLU6, no CLE possible through it), the model after
ReplaceClip6Relu (the float reference of the CLE variants), and CLE with 1 step and until
convergence.

Usage (project venv)::

    python benchmarks/bench_cle_weights.py [--model M.onnx] [-n 64] [--json out.json]
                                           [--eval-x X.npy [--eval-y Y.npy]]

Without ``--eval-x`` the inputs are standard-normal tensors (seed 0) of the model's input shape.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from quark_onnx.config.enums import PowerOfTwoMethod
from quark_onnx.params import pof2
from quark_onnx.passes import CrossLayerEqualization, ReplaceClip6Relu
from quark_onnx.passes.cross_layer_equalization import channel_range_spread

DEFAULT_MODEL = (
    Path(__file__).resolve().parents[2] / "shared" / "models" / "mobilenetv2_rebuilt.onnx"
)


def pof2_quantize(w: np.ndarray, method: PowerOfTwoMethod) -> np.ndarray:
    """Per-tensor int8 power-of-two quantize-dequantize at the ``method`` position."""
    return pof2.fake_quant(w, pof2.weight_position(w, method))


def sqnr_db(ref: np.ndarray, err: np.ndarray) -> float:
    noise = float(np.sum(err.astype(np.float64) ** 2))
    signal = float(np.sum(ref.astype(np.float64) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(signal / noise)


def weight_stats(w: np.ndarray) -> dict[str, float]:
    q = pof2_quantize(w, PowerOfTwoMethod.NonOverflow)
    flat, qflat = w.reshape(w.shape[0], -1), q.reshape(w.shape[0], -1)
    per_channel = [sqnr_db(a, a - b) for a, b in zip(flat, qflat, strict=True) if np.any(a)]
    finite = [v for v in per_channel if np.isfinite(v)]
    return {
        "spread": channel_range_spread(w),
        "sqnr_db": sqnr_db(w, w - q),
        "channel_sqnr_db": float(np.mean(finite)) if finite else float("inf"),
    }


def conv_weights(model: onnx.ModelProto) -> dict[str, tuple[str, int, np.ndarray]]:
    """node name -> (weight name, group, weight) for every Conv with an initializer weight."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in inits:
            group = next((a.i for a in node.attribute if a.name == "group"), 1)
            w = onnx.numpy_helper.to_array(inits[node.input[1]])
            out[node.name] = (node.input[1], group, w)
    return out


def quantize_weights(model: onnx.ModelProto, method: PowerOfTwoMethod) -> onnx.ModelProto:
    """A copy whose Conv/Gemm/MatMul initializer weights are per-tensor pof2 quantized."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    names = {n.input[1] for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")}
    for t in model.graph.initializer:
        if t.name in names:
            w = onnx.numpy_helper.to_array(t)
            t.CopyFrom(
                onnx.numpy_helper.from_array(pof2_quantize(w, method).astype(w.dtype), t.name)
            )
    return model


def run(model: onnx.ModelProto, x: np.ndarray, batch: int = 16) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate(
        [session.run(None, {name: x[i : i + batch]})[0] for i in range(0, len(x), batch)]
    ).reshape(len(x), -1)


def apply(model: onnx.ModelProto, *passes) -> tuple[onnx.ModelProto, list]:
    ir_model = ir.from_proto(model)
    for p in passes:
        ir_model = p(ir_model).model
    return ir.to_proto(ir_model), list(passes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--eval-x", type=Path, help="N x C x H x W float32 .npy (preprocessed)")
    parser.add_argument("--eval-y", type=Path, help="N int labels .npy")
    parser.add_argument("-n", type=int, default=64, help="number of inputs to run")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    original = onnx.load(args.model)
    relu, _ = apply(original, ReplaceClip6Relu())
    t0 = time.perf_counter()
    cle1, (p1,) = apply(relu, CrossLayerEqualization(steps=1))
    t1 = time.perf_counter()
    cle_inf, (pinf,) = apply(relu, CrossLayerEqualization(steps=-1))
    t2 = time.perf_counter()
    print(
        f"CLE steps=1: {len(p1.report.pairs)} pairs, {t1 - t0:.2f} s; steps=-1: "
        f"{pinf.report.iterations} steps, converged={pinf.report.converged}, {t2 - t1:.2f} s"
    )

    before, after = conv_weights(relu), conv_weights(cle_inf)
    changed = [s.node for s in pinf.report.spreads]
    rows = []
    print(
        f"\n{'conv':<10} {'group':>5} {'spread':>17} {'SQNR dB':>15} {'chSQNR dB':>15}\n" + "-" * 66
    )
    for name in changed:
        _, group, w0 = before[name]
        w1 = after[name][2]
        s0, s1 = weight_stats(w0), weight_stats(w1)
        rows.append({"node": name, "group": group, "before": s0, "after": s1})
        print(
            f"{name:<10} {group:>5} {s0['spread']:>8.1f}->{s1['spread']:<8.1f}"
            f"{s0['sqnr_db']:>7.1f}->{s1['sqnr_db']:<7.1f}"
            f"{s0['channel_sqnr_db']:>7.1f}->{s1['channel_sqnr_db']:<7.1f}"
        )
    summary = {}
    for label, select in (("depthwise", lambda r: r["group"] > 1), ("all", lambda r: True)):
        chosen = [r for r in rows if select(r)]
        if chosen:
            summary[label] = {
                key: [
                    float(np.mean([r[side][key] for r in chosen])) for side in ("before", "after")
                ]
                for key in ("sqnr_db", "channel_sqnr_db")
            } | {"count": len(chosen)}
    for label, s in summary.items():
        print(
            f"mean over {s['count']} {label} weights: SQNR {s['sqnr_db'][0]:.2f} -> "
            f"{s['sqnr_db'][1]:.2f} dB, per-channel SQNR {s['channel_sqnr_db'][0]:.2f} -> "
            f"{s['channel_sqnr_db'][1]:.2f} dB"
        )

    # end to end: weight-only per-tensor pof2 quantization, logits against float
    if args.eval_x is not None:
        x = np.load(args.eval_x, mmap_mode="r")[: args.n].astype(np.float32)
    else:
        dims = [d.dim_value or 1 for d in original.graph.input[0].type.tensor_type.shape.dim]
        x = np.random.default_rng(0).standard_normal((args.n, *dims[1:])).astype(np.float32)
    y = np.load(args.eval_y)[: args.n] if args.eval_y is not None else None
    end_to_end = {}
    print(f"\nweight-only per-tensor pof2 int8, {len(x)} inputs ({args.eval_x or 'N(0,1)'}):")
    for label, float_model, reference in (
        ("ReLU6 model, no CLE", original, original),
        ("ReplaceClip6Relu, no CLE", relu, relu),
        ("ReplaceClip6Relu + CLE steps=1", cle1, relu),
        ("ReplaceClip6Relu + CLE steps=-1", cle_inf, relu),
    ):
        ref = run(reference, x)
        flt = run(float_model, x)
        entry = {"float_rel_diff": float(np.abs(flt - ref).max() / np.abs(ref).max())}
        if y is not None:
            entry["float_top1"] = float(np.mean(flt.argmax(1) == y))
        for method in (PowerOfTwoMethod.NonOverflow, PowerOfTwoMethod.MinMSE):
            quant = run(quantize_weights(float_model, method), x)
            tag = method.name
            entry[f"{tag}_logits_sqnr_db"] = sqnr_db(ref, quant - ref)
            entry[f"{tag}_top1_agreement"] = float(np.mean(quant.argmax(1) == ref.argmax(1)))
            if y is not None:
                entry[f"{tag}_top1"] = float(np.mean(quant.argmax(1) == y))
        end_to_end[label] = entry
        print(f"  {label}:\n    " + ", ".join(f"{k} {v:.4g}" for k, v in entry.items()))
    if args.json:
        args.json.write_text(
            json.dumps({"layers": rows, "summary": summary, "end_to_end": end_to_end}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
