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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common


def prepare(args, spec, imported):
    from onnxsim.quark_compat import Config, ModelQuantizer, QConfig, QLayerConfig, XInt8Spec

    imported()
    reader = common.ListReader(common.calibration_batches(args.model))
    qc = QConfig.get_default_config("XINT8")
    qc.global_config = QLayerConfig(activation=XInt8Spec(), weight=qc.global_config.weight)
    qc.extra_options.update(common.XINT8_EXTRA_OPTIONS)
    qc.extra_options["OptimizeModel"] = False
    quantizer = ModelQuantizer(Config(global_quant_config=qc))

    def quantize():
        quantizer.quantize_model(str(spec.float_path), str(args.out), reader)
        return {"approximations": list(quantizer.last_approximations)}

    return quantize


def main() -> int:
    return common.run_tool("onnxsim_quark", "onnxsim.quark_compat (XINT8)", prepare)


if __name__ == "__main__":
    sys.exit(main())
