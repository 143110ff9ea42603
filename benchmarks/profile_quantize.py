"""Where one XINT8 quantization spends its time: per-stage timings, optionally a pyinstrument
profile.

::

    python benchmarks/profile_quantize.py --model mobilenetv2 [--repeats 3] [--profile out.html]

Quantizes ``--model`` with the XINT8 preset as ``run_quark_onnx.py`` does (the shared ImageNet
calibration images of ``benchmarks/.work/data``, batch 1), ``--repeats`` times in this process,
and prints the wall and CPU time of every run with the report's per-stage timings (the fastest
run first). With ``--profile`` the last run is recorded by pyinstrument (its overhead makes that
run slower; its timings are left out of the summary) and written as HTML, with a text tree on
stdout. Timings on a shared machine are only comparable as ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mobilenetv2", choices=sorted(common.MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="pyinstrument HTML of one extra run")
    args = parser.parse_args()

    import numpy as np

    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

    spec = common.MODELS[args.model]
    calib = np.load(spec.calib_path)
    runs = []
    with tempfile.TemporaryDirectory(prefix="quark_onnx_profile_") as tmp:
        out = Path(tmp) / "out.onnx"

        def quantize() -> ModelQuantizer:
            reader = ArrayDataReader({spec.input_name: calib}, batch_size=1)
            quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
            quantizer.quantize_model(str(spec.float_path), str(out), reader)
            return quantizer

        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            quantizer = quantize()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            runs.append((wall, cpu, dict(quantizer.report.timings)))
            print(f"run: wall {wall:.3f} s, cpu {cpu:.3f} s", flush=True)
        if args.profile is not None:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005)
            profiler.start()
            quantize()
            profiler.stop()
            args.profile.write_text(profiler.output_html())
            print(profiler.output_text(unicode=False, color=False, show_all=False))
    for wall, cpu, timings in sorted(runs, key=lambda r: r[0]):
        stages = ", ".join(f"{k} {v:.3f}" for k, v in timings.items())
        print(f"wall {wall:.3f} s, cpu {cpu:.3f} s | {stages}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
