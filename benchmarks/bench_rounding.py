"""Rounding benchmark: the XINT8 preset with and without second-order (GPTQ) rounding.

Run from the repository root (project environment)::

    python benchmarks/bench_rounding.py                                  # classifiers, both sets
    python benchmarks/bench_rounding.py --models squeezenet --configs preset --variants gptq
    python benchmarks/bench_rounding.py --models squeezenet,mobilenetv2 --configs preset \
        --variants shipped,gptq --repeat 3                                # with interleaved time

Models, data and option sets are ``bench_fidelity.py``'s (``--models`` from its classifiers and
stress variants; ``--configs`` ``preset`` and/or ``seed``, the Vitis AI snippet as written).
Variants (``--variants``): ``shipped`` (the option set as it is), ``gptq`` (plus
``include_fast_ft`` with ``FastFinetune = {"OptimAlgorithm": "gptq"}``: second-order rounding of
every Conv/Gemm weight inside bias correction's walk, kept per layer only where it lowers the
layer's reconstruction error on both halves of the held-out calibration samples), ``no_gptq``
(``include_fast_ft`` off), ``move_bias`` (plus ``BiasCorrectionMovePositions``: a saturating
corrected bias moves inside its shift_bias window), ``no_bc`` (bias correction off).

Measured on every test image (digits 719, ImageNet 500 val): top-1 and its drop in points from
the original float model, output SQNR (dB), mean per-image cosine, argmax agreement with float,
quantization wall and CPU time (with ``--repeat N`` the variants of a model are quantized N times
in turn, interleaved, and the fastest of each kept; outputs are byte-identical across repeats),
the wall-time ratio to the ``shipped`` row of the same model and option set, and how many
layers kept the second-order rounding. Results: ``benchmarks/results/<name>.{txt,json}``
(``--name``, default ``rounding``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fidelity as bf
import common
import numpy as np

VARIANTS = (
    "shipped", "gptq", "gptq_weights", "gptq_debiased", "no_gptq", "move_bias",
    "no_bc",
)  # fmt: skip
REFERENCE = "shipped"  # the time ratio's denominator


def tweak(variant: str):
    """The function that turns option set ``qc`` into ``variant`` (None: as shipped)."""
    if variant == "shipped":
        return None
    if variant.startswith("gptq"):
        target = variant.partition("_")[2] or "float"

        def gptq(qc: Any) -> None:
            qc.include_fast_ft = True
            qc.extra_options["FastFinetune"] = {"OptimAlgorithm": "gptq", "Target": target}

        return gptq
    if variant == "no_gptq":
        return lambda qc: setattr(qc, "include_fast_ft", False)
    if variant == "move_bias":
        return lambda qc: qc.extra_options.__setitem__("BiasCorrectionMovePositions", True)
    if variant == "no_bc":
        return lambda qc: setattr(qc, "include_bias_correction", False)
    raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def quantize(entry: bf.Entry, config: str, variant: str) -> tuple[Any, Path, float, float]:
    """Quantize once; the quantizer (its report), the output path, wall and CPU seconds."""
    from quark_onnx import Config, ModelQuantizer

    qc = bf.make_config(config, tweak(variant))
    out = bf.WORK / "out" / f"{entry.name}.{config}.{variant}.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    import onnx

    name = onnx.load(str(entry.float_path), load_external_data=False).graph.input[0].name
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    t0, c0 = time.perf_counter(), time.process_time()
    quantizer.quantize_model(
        str(entry.float_path), str(out), bf.bench_accuracy._Reader(name, entry.calib),
        overwrite=True,
    )  # fmt: skip
    return quantizer, out, time.perf_counter() - t0, time.process_time() - c0


def measure(
    entry: bf.Entry, config: str, variant: str, f_out: dict, float_top1: float, run: tuple
) -> dict:
    quantizer, out, seconds, cpu = run
    report = quantizer.report
    assert report is not None
    row: dict[str, Any] = {"model": entry.name, "config": config, "variant": variant}
    row["quant_seconds"] = round(seconds, 2)
    row["cpu_seconds"] = round(cpu, 2)
    row["stage_seconds"] = {k: v for k, v in report.timings.items() if v >= 0.05}
    if report.adaround:
        row["gptq_layers"] = report.adaround.get("layers")
        row["gptq_kept"] = report.adaround.get("accepted")
        row["gptq_seconds"] = report.adaround.get("seconds")
    row["moved_bias_positions"] = len(report.bias_correction.get("moved_bias_positions", {}))
    row.update(bf.evaluate(entry, f_out, out, float_top1))
    row["float_top1"] = round(float_top1, 4)
    return row


def table(rows: list[dict], meta: dict) -> str:
    lines = [
        f"bench_rounding.py {' '.join(meta['argv'])}: {meta['date']}, {meta['cpu']}, "
        f"{meta['cores']} cores, quark_onnx {meta['commit']}, env {meta['env']}",
        "top-1 and drop (points) against the ORIGINAL float model; SQNR = min over graph outputs "
        "(dB); cos = mean per-image cosine; agree = argmax agreement with float; time x = "
        "quantization wall time / the shipped row's (same run); cpu s = CPU time; kept = layers "
        "that kept GPTQ rounding / layers rounded; gptq s = time inside the rounding",
        "",
        f"{'model':<14} {'config':<7} {'variant':<9} {'float':>6} {'top-1':>6} {'drop':>5} "
        f"{'SQNR':>6} {'cos':>7} {'agree':>6} {'quant s':>7} {'cpu s':>6} {'time x':>6} "
        f"{'kept':>7} {'gptq s':>6}",
    ]
    shipped = {(r["model"], r["config"]): r for r in rows if r["variant"] == REFERENCE}
    for r in rows:
        base = shipped.get((r["model"], r["config"]))
        ratio = r["quant_seconds"] / base["quant_seconds"] if base else float("nan")
        kept = f"{r['gptq_kept']}/{r['gptq_layers']}" if "gptq_kept" in r else "-"
        lines.append(
            f"{r['model']:<14} {r['config']:<7} {r['variant']:<9} {r['float_top1']:6.4f} "
            f"{r['top1']:6.4f} {r['drop_points']:5.2f} {r['min_sqnr_db']:6.2f} "
            f"{next(iter(r['outputs'].values()))['cosine']:7.4f} {r['agreement']:6.3f} "
            f"{r['quant_seconds']:7.2f} {r['cpu_seconds']:6.2f} {ratio:6.2f} {kept:>7} "
            f"{r.get('gptq_seconds') or 0:6.2f}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(bf.CLASSIFIERS))
    parser.add_argument("--configs", default="preset,seed")
    parser.add_argument("--variants", default="shipped,gptq")
    parser.add_argument("--repeat", type=int, default=1, help="quantize N times, keep fastest")
    parser.add_argument("--name", default="rounding")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    variants = args.variants.split(",")

    rows: list[dict] = []
    for model in args.models.split(","):
        entry = bf.load_entry(model)
        if entry.labels is None:
            raise SystemExit(f"{model}: bench_rounding measures labelled classifiers only")
        f_out = bf.run_all(bf.load_entry(entry.base).float_path, entry.test)
        first = next(iter(f_out))
        top = f_out[first].reshape(len(entry.test), -1).argmax(1)
        float_top1 = float(np.mean(top == entry.labels))
        for config in args.configs.split(","):
            best: dict[str, tuple] = {}
            for _ in range(max(args.repeat, 1)):  # interleaved: each variant once per round
                for variant in variants:
                    run = quantize(entry, config, variant)
                    if variant not in best or run[2] < best[variant][2]:
                        best[variant] = run
            for variant in variants:
                rows.append(measure(entry, config, variant, f_out, float_top1, best[variant]))
                keys = ("model", "config", "variant", "top1", "agreement", "min_sqnr_db")
                keys += ("quant_seconds", "cpu_seconds")
                print(json.dumps({k: rows[-1][k] for k in keys}), flush=True)
    info = common.machine_info()
    meta = {
        "env": {
            k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ
        },
        "argv": sys.argv[1:] if argv is None else argv,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpu": info.get("cpu", ""),
        "cores": info.get("cores", ""),
        "commit": bf._git_commit(),
    }
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    bf._atomic_text(common.RESULTS_DIR / f"{args.name}.txt", table(rows, meta))
    bf._atomic_text(
        common.RESULTS_DIR / f"{args.name}.json",
        json.dumps({"run": meta, "rows": rows}, indent=1, default=float) + "\n",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
