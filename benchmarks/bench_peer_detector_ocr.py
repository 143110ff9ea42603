"""AMD Quark's XINT8 on the person detector and the PaddleOCR classifier, measured like ours.

Run from the repository root (project environment; AMD Quark from ``benchmarks/.envs/quark``,
made by ``peers/setup_envs.sh``)::

    python benchmarks/bench_peer_detector_ocr.py

Quark runs in its own environment on the Vitis AI documentation's snippet as ``bench_peers.py``
runs it (``get_default_config("XINT8")``, ``activation_type = QInt8``, ``optimize_model =
False``, ``common.XINT8_EXTRA_OPTIONS``) with the 100 calibration images prepared exactly as
``bench_fidelity.py`` prepares them for these two models (``image_set``); the quantized model is
then evaluated by ``bench_fidelity.evaluate`` on the 500 val images: output SQNR, argmax
agreement (OCR) and the share of the float model's detections matched (detector). The same
numbers for quark_onnx are the ``person`` and ``ppocr`` rows of ``results/fidelity.txt``.
Results: ``results/peer_detector_ocr.{txt,json}``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fidelity
import common

RESULTS = Path(__file__).resolve().parent / "results"

# Runs in the peer's interpreter: argv = model, calibration .npy, output path.
QUARK_CHILD = """
import sys
import numpy as np
import onnx
sys.path.insert(0, {bench!r})
import common
from onnxruntime.quantization.quant_utils import QuantType
from quark.onnx import CalibrationDataReader, ModelQuantizer
from quark.onnx.quantization.config.config import Config
from quark.onnx.quantization.config.custom_config import get_default_config

model, calib, out = sys.argv[1:4]
x = np.load(calib)
name = onnx.load(model, load_external_data=False).graph.input[0].name


class Reader(CalibrationDataReader):
    def __init__(self):
        self.feeds = iter([{{name: x[i : i + 1]}} for i in range(len(x))])

    def get_next(self):
        return next(self.feeds, None)


qc = get_default_config("XINT8")
qc.activation_type = QuantType.QInt8
qc.optimize_model = False
qc.extra_options.update(common.XINT8_EXTRA_OPTIONS)
ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model, out, Reader())
"""


def quantize_with_quark(entry: bench_fidelity.Entry, work: Path) -> Path:
    python = common.ENVS_DIR / "quark" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run benchmarks/peers/setup_envs.sh first")
    calib = work / f"{entry.name}_calib.npy"
    np.save(calib, entry.calib)
    out = work / f"{entry.name}_quark.onnx"
    child = QUARK_CHILD.format(bench=str(Path(__file__).resolve().parent))
    subprocess.run(
        [str(python), "-c", child, str(entry.float_path), str(calib), str(out)],
        check=True,
        cwd=work,
    )
    return out


def main() -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="peer_det_ocr_") as tmp:
        for name in ("person", "ppocr"):
            entry = bench_fidelity.load_entry(name)
            float_out = bench_fidelity.run_all(entry.float_path, entry.test)
            q_path = quantize_with_quark(entry, Path(tmp))
            row = bench_fidelity.evaluate(entry, float_out, q_path, None)
            row.update(model=name, tool="AMD Quark (XINT8 snippet)")
            row["check_ready"] = bench_fidelity.check_ready(q_path)
            rows.append(row)
    lines = [f"{'model':8} {'tool':28} {'SQNR dB':>8} {'agree':>6} {'det':>6} {'NaN':>4} check"]
    for r in rows:
        det = r.get("detection", {}).get("match_rate")
        lines.append(
            f"{r['model']:8} {r['tool']:28} {r['min_sqnr_db']:8.2f} "
            f"{bench_fidelity._fmt(r.get('agreement'), '.3f', 6)} "
            f"{bench_fidelity._fmt(det, '.3f', 6)} {'yes' if r['nan_inf'] else 'no':>4} "
            f"{'yes' if r['check_ready'] else 'no'}"
        )
    text = "\n".join(lines) + "\n"
    print(text, end="")
    RESULTS.mkdir(exist_ok=True)
    bench_fidelity._atomic_text(RESULTS / "peer_detector_ocr.txt", text)
    bench_fidelity._atomic_text(
        RESULTS / "peer_detector_ocr.json", json.dumps(rows, indent=2, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
