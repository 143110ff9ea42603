"""Peak resident memory of quantizing one large MatMul weight, per preset.

The model is ``y = x @ W`` with ``W`` float32 of ``--mib`` MiB (default 100, square), opset 21
(the 4-bit types need it), saved with its weight in an external data file (as large models
are). Each preset runs in a fresh process under the peak-RSS launcher of ``common.py`` (its own
``ru_maxrss``); two peers run the same way in the same invocation, so the quantizer's cost reads
as a ratio:

* ``import``: python with quark_onnx, onnx and onnxruntime imported, nothing loaded;
* ``ort_run``: onnxruntime running the float model once (what executing the weight costs).

The target of issue 40 is a peak of at most 400 MB (about 3x the weight plus a constant).

    python benchmarks/bench_weight_memory.py --presets XINT8,A8W8,UINT4_WEIGHT_ONLY_G32 \
        --name weight_memory
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from common import run_measured  # noqa: E402

_MODEL = r"""
import sys
import numpy as np, onnx
from onnx import TensorProto, helper as h
side, path = int(sys.argv[1]), sys.argv[2]
w = np.random.default_rng(0).standard_normal((side, side), dtype=np.float32)
graph = h.make_graph([h.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "big",
    [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, side])],
    [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, side])],
    [onnx.numpy_helper.from_array(w, "W")])
model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
model.ir_version = 8
onnx.save(model, path, save_as_external_data=True, location="m.onnx.data")
"""

_PEERS = {
    "import": "import quark_onnx, onnx, onnxruntime",
    "ort_run": (
        "import sys, numpy as np, onnxruntime as ort\n"
        "s = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
        "x = s.get_inputs()[0]\n"
        "s.run(None, {x.name: np.ones([1, x.shape[1]], np.float32)})\n"
    ),
}

_QUANTIZE = r"""
import sys
from quark_onnx import Config, ModelQuantizer, get_default_config
model, out, preset = sys.argv[1], sys.argv[2], sys.argv[3]
config = get_default_config(preset)
config.extra_options.update(UseRandomData=True, RandomDataSamples=4)
quantizer = ModelQuantizer(Config(global_quant_config=config))
quantizer.quantize_model(model, out)
"""


def _measure(code: str, *args: str) -> float:
    run = run_measured([sys.executable, "-c", code, *args], timeout_s=1800)
    if run.returncode != 0:
        raise SystemExit(f"failed ({run.returncode}): {run.stderr[-2000:]}")
    return run.maxrss_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=100, help="weight size in MiB (default 100)")
    parser.add_argument("--presets", default="XINT8,A8W8,UINT4_WEIGHT_ONLY_G32")
    parser.add_argument("--name", default=None, help="write results/NAME.{md,json}")
    args = parser.parse_args()
    side = int(((args.mib << 20) // 4) ** 0.5) // 32 * 32
    weight_mb = side * side * 4 / 1e6
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "m.onnx"
        subprocess.run([sys.executable, "-c", _MODEL, str(side), str(model)], check=True)
        for name, code in _PEERS.items():
            rows.append({"run": name, "peak_mb": _measure(code, str(model))})
        for preset in args.presets.split(","):
            out = Path(tmp) / f"{preset}.onnx"
            rows.append(
                {"run": preset, "peak_mb": _measure(_QUANTIZE, str(model), str(out), preset)}
            )
            out.unlink(missing_ok=True)
            Path(str(out) + ".data").unlink(missing_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=BENCH
    ).stdout.strip()
    lines = [
        f"# Peak RSS quantizing one {args.mib} MiB ({weight_mb:.0f} MB) MatMul weight "
        f"({side}x{side} float32)",
        "",
        f"- command: `python benchmarks/bench_weight_memory.py --presets {args.presets}"
        + (f" --name {args.name}`" if args.name else "`")
        + f" at commit {commit}",
        "- peak: `ru_maxrss` of a fresh process per row (MB = 10^6 bytes); ratio: to the weight",
        "- target (issue 40): at most 400 MB",
        "",
        "| run | peak RSS (MB) | / weight | over `import` (MB) |",
        "|---|---:|---:|---:|",
    ]
    base = rows[0]["peak_mb"] * 1.048576
    for row in rows:
        peak = row["peak_mb"] * 1.048576  # MiB -> MB
        row["peak_mb"] = round(peak, 1)
        lines.append(f"| {row['run']} | {peak:.0f} | {peak / weight_mb:.1f} | {peak - base:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.name:
        results = BENCH / "results"
        (results / f"{args.name}.md").write_text(text)
        payload = {"weight_mb": weight_mb, "side": side, "commit": commit, "rows": rows}
        (results / f"{args.name}.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
