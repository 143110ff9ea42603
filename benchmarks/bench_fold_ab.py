"""A/B of the MinMSE histogram binning inside the real calibration loop, in one process.

::

    python benchmarks/bench_fold_ab.py --base HEAD [--model mobilenetv2] [--repeats 5]

Captures the prepared model and the activation names the XINT8 preset calibrates (one
quantization of ``--model`` on 4 images), then times ``quark_onnx.calibration.calibrate`` on the
100 shared calibration images with ``HistogramObserver._bin`` of this checkout and of the
``--base`` revision (its ``observers.py`` loaded beside this one), alternating, and compares the
statistics of every tensor bit for bit. Wall time, process CPU time (all threads: the session's
and the fold's) and the main thread's CPU time (the fold) are reported, fastest of the repeats
and the ratio this checkout / base (medians too). On a shared machine only the ratios
mean something.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--model", default="mobilenetv2", choices=sorted(common.MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import numpy as np

    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
    from quark_onnx.calibration import collector
    from quark_onnx.calibration import observers as head
    from quark_onnx.config.enums import PowerOfTwoMethod

    source = subprocess.run(
        ["git", "show", f"{args.base}:quark_onnx/calibration/observers.py"],
        cwd=common.BENCH_DIR.parent,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "observers_base.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("observers_base", path)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)

    spec_m = common.MODELS[args.model]
    calib = np.load(spec_m.calib_path)
    captured = {}
    original = collector.calibrate

    def capture(model, names, reader, **kwargs):
        captured.update(model=model, names=list(names), kwargs=kwargs)
        return original(model, names, reader, **kwargs)

    collector.calibrate = capture
    import quark_onnx.calibration as calibration_pkg

    calibration_pkg.calibrate = capture
    with tempfile.TemporaryDirectory() as tmp:
        reader = ArrayDataReader({spec_m.input_name: calib[:4]}, batch_size=1)
        quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
        quantizer.quantize_model(str(spec_m.float_path), str(Path(tmp) / "q.onnx"), reader)
    collector.calibrate = original
    calibration_pkg.calibrate = original
    assert captured["kwargs"]["method"] == PowerOfTwoMethod.MinMSE

    bins = {"base": base.HistogramObserver._bin, "head": head.HistogramObserver._bin}
    times: dict[str, list[tuple[float, float, float]]] = {"base": [], "head": []}
    results = {}
    try:
        for repeat in range(args.repeats):
            for rev in ("base", "head") if repeat % 2 == 0 else ("head", "base"):
                head.HistogramObserver._bin = bins[rev]
                reader = ArrayDataReader({spec_m.input_name: calib}, batch_size=1)
                wall, cpu, main = time.perf_counter(), time.process_time(), time.thread_time()
                results[rev] = original(
                    captured["model"], captured["names"], reader, **captured["kwargs"]
                )
                times[rev].append(
                    (
                        time.perf_counter() - wall,
                        time.process_time() - cpu,
                        time.thread_time() - main,
                    )
                )
                print(rev, " ".join(f"{v:.3f}" for v in times[rev][-1]), flush=True)
    finally:
        head.HistogramObserver._bin = bins["head"]
    same = True
    for name in captured["names"]:
        a, b = results["base"].observer(name), results["head"].observer(name)
        if isinstance(a, head.HistogramObserver):
            ka, na, ta = a.nonzero_buckets()
            kb, nb, tb = b.nonzero_buckets()
            same &= bool(
                np.array_equal(ka, kb)
                and np.array_equal(na, nb)
                and np.array_equal(ta, tb)
                and a.square_sums == b.square_sums
                and (a.min, a.max) == (b.min, b.max)
            )
    print(f"{args.model}: calibrate, fastest of {args.repeats} (wall, process CPU, fold CPU)")
    for i, label in enumerate(("wall", "cpu", "fold thread cpu")):
        b, h = min(t[i] for t in times["base"]), min(t[i] for t in times["head"])
        mb = statistics.median(t[i] for t in times["base"])
        mh = statistics.median(t[i] for t in times["head"])
        print(
            f"  {label:16s} base {b:.3f} s  head {h:.3f} s  head/base {h / b:.3f}"
            f"  (medians {mb:.3f} / {mh:.3f} = {mh / mb:.3f})"
        )
    print(f"  statistics identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
