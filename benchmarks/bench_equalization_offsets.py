"""How much the equalization's per-channel rounding boundary moves a quantized model.

::

    python benchmarks/bench_equalization_offsets.py [--models det6t,orient] [--shared person]

EqualizeGatedActivations and EqualizeResidualStreams round each channel's balancing exponent
``0.5 log2(r1 / r2)`` to an integer (``passes/_channel_scaling.power_of_two_scales``). Adding the
same offset to every channel's exponent before rounding changes which channels round up, and
nothing else a float model computes (every candidate is float-exact). This quantizes each model
with the XINT8 preset for offsets 0, 1/4, 1/2 and 3/4 (monkeypatched, nothing in the package
changes) and prints the output SQNR of each on the test images (``bench_unseen``'s for unseen
models, with the fidelity guard's own SQNR on its 16 calibration samples in brackets;
``bench_fidelity``'s for shared ones). Output: ``results/equalization_offsets.txt``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

OFFSETS = (0.0, 0.25, 0.5, 0.75)


def _patch(offset: float) -> None:
    from quark_onnx.passes import _channel_scaling as cs

    def scales(r1, r2, max_log2=cs.MAX_LOG2):
        usable = (r1 > cs.NEGLIGIBLE_RANGE * r1.max()) & (r2 > cs.NEGLIGIBLE_RANGE * r2.max())
        k = np.zeros(r1.shape, dtype=np.float64)
        if not usable.any():
            return np.ones_like(k)
        k[usable] = np.round(0.5 * np.log2(r1[usable] / r2[usable]) + offset)
        k[usable] -= np.round(np.median(k[usable]))
        return np.exp2(np.clip(k, -max_log2, max_log2))

    import quark_onnx.passes.equalize_gated_activations as ega
    import quark_onnx.passes.equalize_residual_streams as ers

    ega.power_of_two_scales = scales
    ers.power_of_two_scales = scales


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="det6t,orient,cls5,ddet")
    parser.add_argument("--shared", default="person,ppocr")
    parser.add_argument("--name", default="equalization_offsets")
    args = parser.parse_args(argv)
    lines = [f"bench_equalization_offsets.py {' '.join(sys.argv[1:])}: {common.machine_info()}"]
    for offset in OFFSETS:
        _patch(offset)
        row = [f"offset {offset:4.2f}:"]
        if args.models:
            import bench_unseen as bu

            for key in args.models.split(","):
                r = bu.measure(key, "repair", 32)
                guard = min(r["guard_sqnr_db"]) if r["guard_sqnr_db"] else float("nan")
                row.append(f"{key} {r['sqnr_db']:6.2f} [guard {guard:5.2f}]")
        if args.shared:
            import bench_fidelity as bf

            for name in args.shared.split(","):
                entry = bf.load_entry(name)
                f_out = bf.run_all(entry.float_path, entry.test)
                r = bf.measure(entry, "preset", f_out, None, rerun=False)
                det = r.get("detection", {}).get("matched")
                row.append(f"{name} {r['min_sqnr_db']:6.2f}" + (f" ({det})" if det else ""))
        lines.append("  ".join(row))
        print(lines[-1], flush=True)
    (common.RESULTS_DIR / f"{args.name}.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
