"""Mixed precision to a fidelity target: what it takes to make XINT8 models faithful, and at what
cost, against the whole-model answer (A16W8).

Run from the repository root (project environment)::

    python benchmarks/bench_mixed_precision.py                       # ppocr and person
    python benchmarks/bench_mixed_precision.py --models ppocr --budgets 0.1,0.25

Per model (``bench_fidelity``'s data: calibration on the 100 calibration images, measured on
the 500 val images the tool never saw), the rows are

* ``xint8``: the XINT8 preset as shipped;
* ``xint8 target b``: the same with ``FidelityTarget`` (``--target-ppocr``, default
  ``sqnr=20``; ``--target-person``, default ``agreement=0.9``: the score part's decisions) and
  ``MixedPrecisionBudget = b`` for each ``--budgets`` value: what the search promoted (tensors,
  share of the activation tensors), the CPU islands and their NPU/CPU transitions, and the
  tool's own verdict on its held-out samples;
* ``a16w8``: the A16W8 preset (every activation 16-bit, float scales), the whole-model switch.

Measured: output SQNR (dB) against the float model over the val images, top-1 agreement
(ppocr), the share of float detections kept (person, ``bench_fidelity.detection_match``),
quantization wall time, and ``quark_onnx.check`` readiness (XINT8 rows; A16W8 is not an XINT8
model). Results: ``benchmarks/results/mixed_precision.{txt,json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_accuracy
import bench_fidelity
import common


def _quantize(entry: Any, preset: str, extra: dict[str, Any], out: Path) -> dict[str, Any]:
    from quark_onnx import Config, ModelQuantizer, get_default_config

    qc = get_default_config(preset)
    qc.extra_options.update(extra)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    name = onnx.load(str(entry.float_path), load_external_data=False).graph.input[0].name
    start = time.perf_counter()
    quantizer.quantize_model(
        str(entry.float_path), str(out), bench_accuracy._Reader(name, entry.calib), overwrite=True
    )
    report = quantizer.report
    mixed = report.mixed_precision or {}
    return {
        "seconds": round(time.perf_counter() - start, 1),
        "verdict": report.faithful,
        "verdict_samples": (report.fidelity or {}).get("samples"),
        "promoted": [p["tensor"] for p in mixed.get("promoted", [])],
        "fraction": mixed.get("fraction"),
        "activation_tensors": mixed.get("activation_tensors"),
        "islands": mixed.get("islands"),
        "transitions": mixed.get("transitions"),
        "met_on_selection": mixed.get("met"),
        "fidelity_seconds": report.timings.get("fidelity"),
    }


def measure(model: str, budgets: list[float], target: str, work: Path) -> list[dict[str, Any]]:
    entry = bench_fidelity.load_entry(model)
    f_out = bench_fidelity.run_all(entry.float_path, entry.test)
    runs = [("xint8", "XINT8", {})]
    runs += [
        (
            f"xint8 target {budget:g}",
            "XINT8",
            {"FidelityTarget": target, "MixedPrecisionBudget": budget},
        )
        for budget in budgets
    ]
    runs.append(("a16w8", "A16W8", {}))
    rows = []
    for label, preset, extra in runs:
        path = work / f"{model}_{label.replace(' ', '_')}.onnx"
        row = {"model": model, "config": label, "target": extra.get("FidelityTarget")}
        row.update(_quantize(entry, preset, extra, path))
        measured = bench_fidelity.evaluate(entry, f_out, path, None)
        row["sqnr_db"] = round(measured["min_sqnr_db"], 2)
        row["agreement"] = measured.get("agreement")
        row["kept"] = (measured.get("detection") or {}).get("match_rate")
        row["ready"] = bench_fidelity.check_ready(path) if preset == "XINT8" else None
        print(_line(row), flush=True)
        rows.append(row)
    return rows


HEADER = (
    f"{'model':7s} {'config':18s} {'SQNR':>6s} {'agree':>6s} {'kept':>6s} {'promoted':>12s} "
    f"{'islands':>7s} {'trans':>5s} {'ready':>5s} {'quant s':>7s}  verdict (held out)"
)


def _line(row: dict[str, Any]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    promoted = (
        f"{len(row['promoted'])} ({100 * row['fraction']:.1f} %)"
        if row.get("fraction") is not None
        else "-"
    )
    verdict = "-" if row["verdict"] is None else ("yes" if row["verdict"] else "NO")
    return (
        f"{row['model']:7s} {row['config']:18s} {fmt(row['sqnr_db'], '.2f'):>6s} "
        f"{fmt(row['agreement'], '.3f'):>6s} {fmt(row['kept'], '.3f'):>6s} {promoted:>12s} "
        f"{fmt(row['islands'], 'd'):>7s} {fmt(row['transitions'], 'd'):>5s} "
        f"{fmt(row['ready'], ''):>5s} {row['seconds']:7.1f}  {verdict} ({row['verdict_samples']})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="ppocr,person")
    parser.add_argument("--budgets", default="0.1", help="MixedPrecisionBudget values")
    parser.add_argument("--target-ppocr", default="sqnr=20")
    parser.add_argument("--target-person", default="agreement=0.9")
    parser.add_argument("--name", default="mixed_precision")
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    info = common.machine_info()
    head = (
        f"bench_mixed_precision.py {' '.join(sys.argv[1:])}: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {info.get('cpu', '')}, "
        f"{info.get('cores', '')} cores, quark_onnx {bench_fidelity._git_commit()}\n"
        "SQNR of the first output against the float model on the 500 val images; agree = top-1 "
        "agreement; kept = share of float detections matched (IoU >= 0.5); promoted = activation "
        "tensors promoted (share of the plan's); islands/trans = CPU islands and NPU/CPU "
        "transitions; verdict = the tool's own on its held-out calibration samples\n"
    )
    print(head + HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mixed_precision_") as tmp:
        for model in args.models.split(","):
            target = args.target_person if model == "person" else args.target_ppocr
            rows += measure(model, budgets, target, Path(tmp))
    text = head + HEADER + "\n" + "\n".join(_line(r) for r in rows) + "\n"
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (common.RESULTS_DIR / f"{args.name}.txt").write_text(text)
    payload = {"command": " ".join(sys.argv), "rows": rows}
    (common.RESULTS_DIR / f"{args.name}.json").write_text(
        json.dumps(payload, indent=1, default=_plain) + "\n"
    )
    return 0


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else str(value)


if __name__ == "__main__":
    raise SystemExit(main())
