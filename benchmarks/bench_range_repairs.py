"""Range repairs: XINT8 top-1 and output SQNR of the shared CNNs and their stress variants.

Run from the repository root::

    python benchmarks/bench_range_repairs.py                                  # everything
    python benchmarks/bench_range_repairs.py --models squeezenet --kinds orig,deadconst \\
        --settings off,fold

For each model (``digits``, ``squeezenet``, ``mobilenetv2``), each variant (``orig``, and the stress
variants ``rescale``, ``deadconst``, ``both`` written by ``make_stress_variants.py`` with seed 0
under ``benchmarks/.work/stress/``, made when missing) and each setting, the XINT8 preset
quantizes the variant on the 100 calibration images and the quantized model is scored on the 500
val images (data and pre-processing of ``bench_accuracy.py``; digits: 200 calibration, 719 test
images). Settings: ``off`` (``FoldConstantChannels`` and ``include_cle`` off), ``fold``
(``FoldConstantChannels`` on, CLE off), ``preset`` (the XINT8 preset as it is: both on, CLE
with its component gate); ``seed`` (not in the default list) is the Vitis AI documentation's
snippet as written, ``bench_fidelity.make_config("seed")``. Printed per run: top-1, the drop
from the **original** float model in points, top-1 agreement with it, the output SQNR against it
(dB) and the quantization time.
The stress variants compute what the original computes (to ~1e-5), so every column should match
the ``orig`` row.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from bench_accuracy import MODELS, _Reader, dataset, fidelity, logits  # noqa: E402

STRESS_DIR = BENCH / ".work" / "stress"
KINDS = ("orig", "rescale", "deadconst", "both")
SETTINGS = ("off", "fold", "preset")
ALL_SETTINGS = (*SETTINGS, "seed")


def variant_path(model: str, kind: str) -> Path:
    """The model file of ``kind`` (the stress variants are made on first use)."""
    original = MODELS[model]
    if kind == "orig":
        return original
    path = STRESS_DIR / f"{original.stem}_{kind}.onnx"
    if not path.exists():
        import make_stress_variants as msv

        STRESS_DIR.mkdir(parents=True, exist_ok=True)
        msv.build(original, kind, 0, path)
    return path


def run(model: str, kind: str, setting: str, data: tuple, f_orig: np.ndarray) -> dict:
    import onnx

    from quark_onnx import Config, ModelQuantizer, get_default_config

    cx, tx, ty = data
    path = variant_path(model, kind)
    if setting not in ALL_SETTINGS:
        raise SystemExit(f"unknown setting {setting!r}; use {', '.join(ALL_SETTINGS)}")
    qc = get_default_config("XINT8")
    if setting == "seed":
        from bench_fidelity import make_config

        qc = make_config("seed")
    elif setting != "preset":
        qc.extra_options["FoldConstantChannels"] = setting == "fold"
        qc.include_cle = False
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    name = onnx.load(str(path), load_external_data=False).graph.input[0].name
    start = time.perf_counter()
    quantized = quantizer.quantize_model(str(path), None, _Reader(name, cx))
    seconds = time.perf_counter() - start
    out = logits(quantized, tx)
    top1 = float(np.mean(out.argmax(1) == ty))
    return {"top1": top1, "seconds": seconds, **fidelity(out, f_orig)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="digits,squeezenet,mobilenetv2")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for model in args.models.split(","):
        data = dataset(model)
        f_orig = logits(MODELS[model], data[1])
        float_top1 = float(np.mean(f_orig.argmax(1) == data[2]))
        print(f"\n{model}: original float top-1 {float_top1:.4f} on {len(data[1])} images")
        header = f"{'variant':<10} {'setting':<10} {'top-1':>7} {'drop':>6} {'agree':>6}"
        print(f"  {header} {'SQNR dB':>8} {'quant s':>8}")
        for kind in args.kinds.split(","):
            for setting in args.settings.split(","):
                r = run(model, kind, setting, data, f_orig)
                print(
                    f"  {kind:<10} {setting:<10} {r['top1']:7.4f} "
                    f"{100 * (float_top1 - r['top1']):6.2f} {r['agreement']:6.3f} "
                    f"{r['sqnr_db']:8.2f} {r['seconds']:8.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
