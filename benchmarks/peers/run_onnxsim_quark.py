"""Quantize one benchmark model with onnxsim's Quark-compatible shim (``onnxsim.quark_compat``).

Runs in ``benchmarks/.envs/bench`` (onnxsim 0.8.1, the project's pinned version). The shim's
``XINT8`` preset is configured the way the Vitis AI docs configure Quark (shared/seeds/004):
signed int8 activations (Quark's ``activation_type = QInt8``; the preset's default is uint8),
``OptimizeModel=False`` (Quark's ``optimize_model = False``) and the mandatory extra options
(``common.XINT8_EXTRA_OPTIONS``). Unlike Quark, the shim runs CLE only when asked, so this is
the plain preset without CLE.

Timing: ``quant_s`` from just before ``quantize_model`` (which loads the model) until the output
file exists; imports and reading the cached calibration arrays are outside it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common


def main() -> int:
    args = common.runner_args("onnxsim.quark_compat (XINT8)")
    spec = common.MODELS[args.model]
    result: dict = {"tool": "onnxsim_quark", "model": args.model, "ok": False}
    try:
        t0 = time.perf_counter()
        from onnxsim.quark_compat import Config, ModelQuantizer, QConfig, QLayerConfig, XInt8Spec

        result["import_s"] = time.perf_counter() - t0
        reader = common.ListReader(common.calibration_batches(args.model))
        qc = QConfig.get_default_config("XINT8")
        qc.global_config = QLayerConfig(activation=XInt8Spec(), weight=qc.global_config.weight)
        qc.extra_options.update(common.XINT8_EXTRA_OPTIONS)
        qc.extra_options["OptimizeModel"] = False
        quantizer = ModelQuantizer(Config(global_quant_config=qc))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["rss_before_quant_mb"] = common.peak_rss_mb()
        t1, c1 = time.perf_counter(), time.process_time()
        quantizer.quantize_model(str(spec.float_path), str(args.out), reader)
        if not args.out.exists():
            raise RuntimeError(f"onnxsim returned without writing {args.out}")
        result["quant_s"] = time.perf_counter() - t1
        result["quant_cpu_s"] = time.process_time() - c1
        result["approximations"] = list(quantizer.last_approximations)
        result["vmhwm_mb"] = common.peak_rss_mb()
        result["ok"] = True
    except BaseException as exc:  # recorded, the driver reports it
        result["error"] = common.error_text(exc)
    common.write_result(args.result, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
