"""Every quark_onnx preset and onnxruntime's quantizers on the BERT-style test encoder, one run.

The model is ``tests/transformer/bert_like.py``'s encoder (default: 4 layers, hidden 256, 4
heads, FFN 1024, a 30522-row word embedding, 64 tokens, an additive attention mask written as
PyTorch's exporter writes it, seeded random weights scaled like a trained model's) with the
outlier channels of trained encoders (``with_outliers``: LayerNorm gains 20-60 on four hidden
dimensions per LayerNorm, compensated in the weights reading them; ``--plain``: without).
Calibration: 64 sentences (seed 1); evaluation: 128 held-out sentences (seed 2), random lengths,
padded. ``A8W8 without MigrateActivationOutliers`` is the A8W8 preset with that pass off: what
the outlier channels cost per-tensor int8 activations; ``INT8_DYNAMIC with
MigrateActivationOutliers`` turns it on in the dynamic preset (which then needs the calibration
data the pass measures on).

For each tool it prints and records:

* cosine of the mean-pooled sentence embeddings against the float model (mean and min over the
  held-out sentences), onnxruntime with its default graph optimizations (what a user runs);
* quantize time (s), file size as a fraction of the float file;
* latency: median of 50 batch-1 runs (one 64-token sentence), onnxruntime CPU, one thread,
  default optimizations, each model timed interleaved with the float model (A B A B ...) so a
  change of machine load hits both; the ratio is quantized / float, the median over 3 such
  rounds.

Peers (measured, never used inside quark_onnx): onnxruntime ``quantize_dynamic`` (int8 weights,
its defaults) and ``quantize_static`` (QDQ, MinMax, per-channel int8 weights, uint8 activations,
its defaults). The ``XINT8`` row is the NPU CNN preset on a model it was not designed for (it
warns). ``UINT4_WEIGHT_ONLY_G32 MatMulNBits`` is the same model exported by
``quark_onnx.export_matmul_nbits``.

Usage (repository root)::

    python benchmarks/bench_transformer.py [--layers 4 --hidden 256 --seq 64] [--plain]
        [--name transformer] [--tools A8W8,A16W8]

Writes ``benchmarks/results/<name>.json`` and ``<name>.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests" / "transformer"))

from bert_like import (  # noqa: E402
    EncoderShape,
    build_encoder,
    cosines,
    encoder_inputs,
    mean_pooled,
    with_outliers,
)

from quark_onnx import (  # noqa: E402
    ArrayDataReader,
    Config,
    ModelQuantizer,
    export_matmul_nbits,
    get_default_config,
)
from quark_onnx.config.presets import preset_names  # noqa: E402

RUNS = 50
ROUNDS = 3


def _session(path: Path, threads: int = 0) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _embeddings(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = _session(path)
    fixed = session.get_inputs()[0].shape[0]
    step = fixed if isinstance(fixed, int) else 16
    n = len(feeds["input_ids"])
    hidden = np.concatenate(
        [
            session.run(None, {k: v[i : i + step] for k, v in feeds.items()})[0]
            for i in range(0, n, step)
        ]
    )
    return mean_pooled(hidden, feeds["attention_mask"])


def _paired_latency(float_path: Path, path: Path, feed: dict[str, np.ndarray]) -> float:
    """Latency ratio quantized / float: the median of ``ROUNDS`` ratios, each of the medians of
    ``RUNS`` interleaved runs (see the module docstring). On a shared machine another process
    can take the core for a whole round; the median of the rounds drops such a round."""
    sessions = [_session(float_path, threads=1), _session(path, threads=1)]
    for s in sessions:
        for _ in range(5):
            s.run(None, feed)
    ratios = []
    for _ in range(ROUNDS):
        times: list[list[float]] = [[], []]
        for _ in range(RUNS):
            for i, s in enumerate(sessions):
                t0 = time.perf_counter()
                s.run(None, feed)
                times[i].append(time.perf_counter() - t0)
        ratios.append(np.median(times[1]) / np.median(times[0]))
    return float(np.median(ratios))


def _ort_dynamic(src: Path, dst: Path, calib: dict[str, np.ndarray]) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)


def _ort_static(src: Path, dst: Path, calib: dict[str, np.ndarray]) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.i = 0

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self.i >= len(calib["input_ids"]):
                return None
            feed = {k: v[self.i : self.i + 1] for k, v in calib.items()}
            self.i += 1
            return feed

    quantize_static(
        str(src),
        str(dst),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )


def _quark_onnx(preset: str, **extra_options: Any):
    def run(src: Path, dst: Path, calib: dict[str, np.ndarray]) -> None:
        qconfig = get_default_config(preset)
        qconfig.extra_options.update(extra_options)
        quantizer = ModelQuantizer(Config(global_quant_config=qconfig))
        quantizer.quantize_model(src, dst, ArrayDataReader(calib, batch_size=8))

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--plain", action="store_true", help="no outlier channels")
    parser.add_argument("--name", default="transformer")
    parser.add_argument("--tools", default="", help="comma-separated subset of the rows")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    shape = EncoderShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=max(1, args.hidden // 64),
        ffn=4 * args.hidden,
        seq=args.seq,
    )
    if not args.plain:
        shape = with_outliers(shape)
    calib = encoder_inputs(64, 1, shape)
    test = encoder_inputs(128, 2, shape)
    timing_feed = {k: v[:1] for k, v in encoder_inputs(1, 3, shape).items()}
    timing_feed["attention_mask"][:] = 1  # one full-length sentence
    timing_feed["input_ids"][:] = np.maximum(timing_feed["input_ids"], 101)

    tools: dict[str, Any] = {}
    for preset in preset_names():
        tools[preset] = _quark_onnx(preset)
        if preset == "A8W8":
            off = _quark_onnx(preset, MigrateActivationOutliers=False)
            tools[f"{preset} without MigrateActivationOutliers"] = off
        if preset == "INT8_DYNAMIC":
            on = _quark_onnx(preset, MigrateActivationOutliers=True)
            tools[f"{preset} with MigrateActivationOutliers"] = on
    tools["onnxruntime quantize_dynamic"] = _ort_dynamic
    tools["onnxruntime quantize_static (QDQ, per-channel)"] = _ort_static
    wanted = [t for t in args.tools.split(",") if t]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        float_path = work / "float.onnx"
        onnx.save(build_encoder(shape, seed=0), float_path)
        reference = _embeddings(float_path, test)
        float_size = float_path.stat().st_size
        print(f"float model: {float_size / 1e6:.1f} MB, {shape}")
        print(
            f"{'tool':50s} {'cos mean':>9s} {'cos min':>8s} {'quant s':>8s} {'size':>6s} "
            f"{'latency':>8s}"
        )

        def measure(name: str, path: Path, seconds: float | None, error: str | None) -> None:
            row: dict[str, Any] = {"tool": name, "quantize_s": seconds, "error": error}
            if error is None:
                try:
                    c = cosines(reference, _embeddings(path, test))
                    row.update(
                        cos_mean=float(np.mean(c)),
                        cos_min=float(np.min(c)),
                        size_ratio=path.stat().st_size / float_size,
                        latency_ratio=_paired_latency(float_path, path, timing_feed),
                    )
                except Exception as exc:  # a tool's model onnxruntime cannot run: recorded
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            if row["error"] is None:
                print(
                    f"{name:50s} {row['cos_mean']:9.5f} {row['cos_min']:8.5f} "
                    f"{seconds or 0:8.2f} {row['size_ratio']:6.3f} {row['latency_ratio']:7.2f}x",
                    flush=True,
                )
            else:
                print(f"{name:50s} FAILED {row['error']}", flush=True)

        for name, run in tools.items():
            if wanted and name not in wanted:
                continue
            path = work / f"{len(rows)}.onnx"
            start = time.perf_counter()
            error = None
            try:
                run(float_path, path, calib)
            except Exception as exc:  # recorded, the benchmark goes on
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            measure(name, path, time.perf_counter() - start, error)
            if name == "UINT4_WEIGHT_ONLY_G32" and error is None:
                nbits = work / "nbits.onnx"
                start = time.perf_counter()
                export_matmul_nbits(path, nbits)
                measure(f"{name} MatMulNBits export", nbits, time.perf_counter() - start, None)

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, onnxruntime {ort.__version__}",
        "model": {**shape.__dict__, "float_mb": round(float_size / 1e6, 2)},
        "outlier_channels": not args.plain,
        "calibration_sentences": 64,
        "test_sentences": 128,
        "latency": f"median of {RUNS} interleaved with float, 1 thread, batch 1, {shape.seq} "
        f"tokens, ratio to float (median of {ROUNDS} rounds)",
        "rows": rows,
    }
    out = BENCH_DIR / "results"
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    outliers = (
        f", with the outlier channels of trained encoders (LayerNorm gains "
        f"{shape.outlier_scale / 2:g}-{1.5 * shape.outlier_scale:g} on "
        f"{len(shape.outlier_dims)} dimensions per LayerNorm, compensated in the weights reading "
        f"them; `tests/transformer/bert_like.py`)"
        if shape.outlier_dims
        else " without outlier channels (`--plain`)"
    )
    command = "python benchmarks/bench_transformer.py" + (" --plain" if args.plain else "")
    lines = [
        f"# Transformer encoder: every preset and onnxruntime's quantizers ({result['date']})",
        "",
        f"Model: {shape.layers}-layer BERT-style encoder, hidden {shape.hidden}, "
        f"{shape.vocab}-row embedding, {shape.seq} tokens, float file {float_size / 1e6:.1f} MB"
        f"{outliers}. "
        f"Cosine of mean-pooled embeddings vs float on 128 held-out sentences; latency "
        f"{result['latency']}. `{command}`",
        "",
        "| tool | cosine mean / min | quantize s | file vs float | latency vs float |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["error"] is None:
            lines.append(
                f"| {r['tool']} | {r['cos_mean']:.5f} / {r['cos_min']:.5f} | "
                f"{r['quantize_s']:.1f} | {r['size_ratio']:.3f} | {r['latency_ratio']:.2f}x |"
            )
        else:
            lines.append(f"| {r['tool']} | failed: {r['error']} | | | |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
