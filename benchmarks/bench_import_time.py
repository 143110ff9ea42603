"""Time of ``import quark_onnx`` in a fresh interpreter, against ``import numpy`` in the same run.

Each sample is a new ``python -X importtime -c "import MODULE"`` process; the cumulative time
Python reports for the module's own line (microseconds) is taken, so interpreter start-up is not
counted. Samples of quark_onnx and of the peer alternate, and the medians are compared: on a
busy machine both slow down together, so the ratio is steadier than the absolute figure.

    python benchmarks/bench_import_time.py [--samples 21] [--write]

``--write`` stores the result in ``benchmarks/results/import_time.json``. The target is
``import quark_onnx`` <= 0.1 s; ``tests/test_structure.py`` checks (without timing) that the
import loads none of the heavy modules (numpy, onnx, onnxruntime, onnxsim, onnx_ir, ml_dtypes).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "import_time.json"
PEER = "numpy"


def import_us(module: str) -> int:
    """Cumulative import time of ``module`` (us) in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    for line in reversed(done.stderr.splitlines()):
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[2] == module:
            return int(parts[1])
    raise RuntimeError(f"no importtime line for {module}:\n{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=21)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    ours, peer = [], []
    for _ in range(args.samples):
        ours.append(import_us("quark_onnx"))
        peer.append(import_us(PEER))
    result = {
        "quark_onnx_median_s": statistics.median(ours) / 1e6,
        "quark_onnx_min_s": min(ours) / 1e6,
        f"{PEER}_median_s": statistics.median(peer) / 1e6,
        "ratio_to_peer": statistics.median(ours) / statistics.median(peer),
        "samples": args.samples,
        "target_s": 0.1,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(json.dumps(result, indent=1))
    if args.write:
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["quark_onnx_median_s"] <= 0.1 else 1


if __name__ == "__main__":
    sys.exit(main())
