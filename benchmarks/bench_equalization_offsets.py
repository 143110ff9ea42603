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

``--measured``: instead of one offset for all, EqualizeGatedActivations picks the offset per
gated layer by the quantization error measured at that layer's readers (the producer output and
the product on two samples' real values at their MinMSE positions, the producer's and readers'
power-of-two weight errors, each weighted by what the readers' weights carry of it).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

OFFSETS = (0.0, 0.25, 0.5, 0.75)


def _patch(offset: float) -> None:
    from quark_onnx.passes import _channel_scaling as cs
    from quark_onnx.passes import equalize_gated_activations as ega
    from quark_onnx.passes import equalize_residual_streams as ers

    ega.power_of_two_scales = partial(cs.power_of_two_scales, offset=offset)
    ers.power_of_two_scales = partial(cs.power_of_two_scales, offset=offset)


def _patch_measured() -> None:
    """Per gated layer, the offset whose measured error at the readers is smallest (module doc)."""
    from quark_onnx.params import pof2
    from quark_onnx.passes import _channel_scaling as cs
    from quark_onnx.passes import equalize_gated_activations as ega
    from quark_onnx.passes._cle_noise import column_energy, quant_error
    from quark_onnx.runtime import sessions

    values: dict[str, np.ndarray] = {}
    measure, apply = ega.EqualizeGatedActivations._measure, ega.EqualizeGatedActivations._apply

    def measured(self, model, names):
        out = measure(self, model, names)
        values.clear()
        names = sorted({n for n in names if n})
        if self.sample_feeds and names:
            session = sessions.create_session(
                model, purpose="probe", edit=lambda p: sessions.add_outputs(p, names)
            )
            runs = [session.run(names, dict(feed)) for feed in self.sample_feeds[:2]]
            for i, name in enumerate(names):
                flat = [np.moveaxis(r[i].astype(np.float64), 1, 0) for r in runs]
                values[name] = np.concatenate([f.reshape(f.shape[0], -1) for f in flat], axis=1)
        return out

    def quant_mse(v: np.ndarray) -> np.ndarray:
        v32 = v.astype(np.float32)
        e = pof2.fake_quant(v32, pof2.minmse_position(v32)).astype(np.float64) - v
        return np.mean(e**2, axis=1)

    def chosen(graph, conv, w1, b1, r1, head, x, readers, shifts, names):
        r2 = np.max([rd.ranges(w1.shape[0]) for rd in readers], axis=0)
        cands = [cs.power_of_two_scales(r1, r2, offset=offset) for offset in OFFSETS]
        xv = values.get(x.name or "")

        def error(s: np.ndarray) -> float:
            xs = xv / s[:, None]
            ys = np.maximum(xs, 0.0)  # the product's range: about the positive part
            reads = sum(
                column_energy(rd.scaled(s).astype(np.float64), rd.group)[rd.offset :][: len(s)]
                for rd in readers
            )
            total = float(np.sum(reads * (quant_mse(xs) + quant_mse(ys))))
            for rd in readers:
                ew = column_energy(quant_error(rd.scaled(s)), rd.group)[rd.offset :][: len(s)]
                total += float(np.sum(ew * np.mean(ys**2, axis=1)))
            w1s = (w1.astype(np.float64) / s.reshape(-1, *([1] * (w1.ndim - 1)))).astype(w1.dtype)
            rows = np.square(quant_error(w1s)).reshape(len(s), -1).sum(axis=1)
            energy = np.square(w1s.astype(np.float64)).reshape(len(s), -1).sum(axis=1)
            total += float(np.sum(rows / np.maximum(energy, 1e-30) * np.mean(xs**2, 1) * reads))
            return total

        best = min(cands, key=error) if xv is not None and xv.shape[0] == len(r1) else cands[0]
        ega.power_of_two_scales = lambda *a, **k: best
        try:
            return apply(graph, conv, w1, b1, r1, head, x, readers, shifts, names)
        finally:
            ega.power_of_two_scales = cs.power_of_two_scales

    ega.EqualizeGatedActivations._measure = measured
    ega.EqualizeGatedActivations._apply = staticmethod(chosen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="det6t,orient,cls5,ddet")
    parser.add_argument("--shared", default="person,ppocr")
    parser.add_argument("--name", default="equalization_offsets")
    parser.add_argument("--measured", action="store_true", help="per-layer choice (module doc)")
    args = parser.parse_args(argv)
    lines = [f"bench_equalization_offsets.py {' '.join(sys.argv[1:])}: {common.machine_info()}"]
    for offset in (None,) if args.measured else OFFSETS:
        if offset is None:
            _patch_measured()
        else:
            _patch(offset)
        row = ["per-layer measured:" if offset is None else f"offset {offset:4.2f}:"]
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
