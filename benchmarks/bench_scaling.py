"""Node-count scaling of the XINT8 quantizer: time per node and peak memory as graphs grow.

Run from the repository root::

    python benchmarks/bench_scaling.py                      # Conv 1k..20k, Add 50k
    python benchmarks/bench_scaling.py --conv 1000 5000 --add 0
    python benchmarks/bench_scaling.py --json benchmarks/results/scaling.json
    python benchmarks/bench_scaling.py --conv 1000 2000 20000 --add 0 --repeat 3   # medians

Models (built here with ``onnx.helper``, weights from a fixed seed):

* ``conv N``: ``x[1,4,8,8]`` through N 1x1 Convs (4 -> 4 channels, orthogonal weights so values
  stay in range at any depth, small bias): the plan, the calibration outputs, the constraint
  solver and Q/DQ insertion all grow with N while every node stays tiny, so any cost above O(N)
  shows as a growing time/node.
* ``add N``: ``x[1,16]`` through N ``Add`` nodes, each adding a constant ``[16]`` vector: the
  model is small on disk (~1.7 MB at 50k) and peak memory measures per-node bookkeeping.

``--no-cle`` quantizes without CrossLayerEqualization, to time the rest of the quantizer alone:
the XINT8 preset equalizes each chain to its balanced point (solved per chain, then confirmed by
a sweep; ``passes/_cle_balance.py``), the largest stage on these chains.

Each size runs in a fresh interpreter (``python -c``) so that its peak resident memory
(``ru_maxrss``) is its own; the quantizer's per-stage timings come from its report. Besides wall
time, the child's CPU time (``time.process_time``, all its threads) is reported: on a shared
machine it moves far less with the load than wall time does. XINT8 preset,
2 random calibration samples, ``optimize_model=False`` (onnxsim would fold the chain).

Targets: time/node at 20k Convs at most 1.5x that at 1k; peak RSS of 50k Adds at most 400 MB.
This is a measurement, not a test: numbers move by a few percent between runs on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_chain(kind: str, n: int, path: Path) -> None:
    """Write the ``conv`` or ``add`` chain of ``n`` nodes (module doc) to ``path``."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    if kind == "conv":
        c = 4
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 8, 8])
        y = helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [1, c, 8, 8])
        for i in range(n):
            # an orthogonal matrix: activations keep their norm through any depth
            w = np.linalg.qr(rng.standard_normal((c, c)))[0][:, :, None, None]
            inits.append(onnx.numpy_helper.from_array(w.astype(np.float32), f"w{i}"))
            b = rng.standard_normal(c).astype(np.float32) * 0.1
            inits.append(onnx.numpy_helper.from_array(b, f"b{i}"))
            nodes.append(
                helper.make_node(
                    "Conv",
                    ["x" if i == 0 else f"t{i}", f"w{i}", f"b{i}"],
                    [f"t{i + 1}"],
                    name=f"conv{i}",
                    kernel_shape=[1, 1],
                    strides=[1, 1],
                    pads=[0, 0, 0, 0],
                    dilations=[1, 1],
                    group=1,
                )
            )
    elif kind == "add":
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])
        y = helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [1, 16])
        for i in range(n):
            v = (rng.standard_normal(16) * 0.01).astype(np.float32)
            inits.append(onnx.numpy_helper.from_array(v, f"c{i}"))
            nodes.append(
                helper.make_node(
                    "Add", ["x" if i == 0 else f"t{i}", f"c{i}"], [f"t{i + 1}"], name=f"add{i}"
                )
            )
    else:
        raise ValueError(f"unknown chain kind {kind!r}: conv or add")
    graph = helper.make_graph(nodes, "chain", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


_CHILD = textwrap.dedent(
    """
    import json, resource, sys, tempfile, time
    from pathlib import Path

    sys.path.insert(0, "benchmarks")
    from bench_scaling import build_chain

    kind, n, cle = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cle"
    folder = Path(tempfile.mkdtemp())
    path = folder / "chain.onnx"
    build_chain(kind, n, path)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    from quark_onnx import Config, ModelQuantizer, get_default_config
    qc = get_default_config("XINT8")
    qc.optimize_model = False
    qc.include_cle = qc.include_cle and cle
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=2)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    start, cpu = time.perf_counter(), time.process_time()
    quantizer.quantize_model(path, folder / "q.onnx", progress=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "kind": kind, "nodes": n, "cle": qc.include_cle, "seconds": seconds,
        "us_per_node": seconds / n * 1e6, "cpu_seconds": cpu, "cpu_us_per_node": cpu / n * 1e6,
        "peak_rss_mb": round(peak, 1), "rss_after_build_mb": round(built, 1),
        "model_mb": round(path.stat().st_size / 2**20, 2),
        "stages": quantizer.report.timings,
        "stage_peak_rss_mb": quantizer.report.peak_rss_mb,
    }))
    """
)


def run(kind: str, n: int, profile: str | None = None, cle: bool = True) -> dict:
    """Quantize one chain in a fresh interpreter; its measurements as a dict."""
    if profile:
        cmd = [sys.executable, "-m", "pyinstrument", "-o", profile, "-r", "text", "-c", _CHILD]
    else:
        cmd = [sys.executable, "-c", _CHILD]
    proc = subprocess.run(
        [*cmd, kind, str(n), "cle" if cle else "no-cle"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} {n}: failed\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_run(rows: list[dict]) -> dict:
    """The run of median wall time (the lower middle one of an even count), with every run's
    wall and CPU seconds."""
    ordered = sorted(rows, key=lambda r: r["seconds"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["runs_seconds"] = [round(r["seconds"], 2) for r in rows]
    row["runs_cpu_seconds"] = [round(r["cpu_seconds"], 2) for r in rows]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conv", type=int, nargs="*", default=[1000, 2000, 5000, 10000, 20000])
    parser.add_argument("--add", type=int, nargs="*", default=[50000])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument(
        "--no-cle", action="store_true", help="XINT8 without CrossLayerEqualization (module doc)"
    )
    parser.add_argument(
        "--profile", metavar="DIR", type=Path, help="write a pyinstrument text profile per size"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run every size N times (rounds over all sizes, so a load spike hits one run of "
        "each, not all runs of one) and keep the run of median wall time",
    )
    args = parser.parse_args()
    sizes = [("conv", n) for n in args.conv] + [("add", n) for n in args.add if n]
    runs: dict[tuple[str, int], list[dict]] = {size: [] for size in sizes}
    rows: list[dict] = []
    for round_ in range(args.repeat):
        for kind, n in sizes:
            profile = str(args.profile / f"{kind}{n}.txt") if args.profile else None
            row = run(kind, n, profile, cle=not args.no_cle)
            runs[(kind, n)].append(row)
            stages = ", ".join(
                f"{k} {v:.1f}" for k, v in sorted(row["stages"].items(), key=lambda kv: -kv[1])[:4]
            )
            print(
                f"[{round_ + 1}/{args.repeat}] {kind:4} {n:6d} nodes: {row['seconds']:7.1f} s  "
                f"{row['us_per_node']:7.0f} us/node  cpu {row['cpu_us_per_node']:7.0f} us/node  "
                f"peak {row['peak_rss_mb']:6.0f} MB  ({stages})",
                flush=True,
            )
        rows = [_median_run(runs[size]) for size in sizes if runs[size]]
        if args.json:  # after every round: a cut-short run keeps what it measured
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    conv = {r["nodes"]: r for r in rows if r["kind"] == "conv"}
    if conv:
        large = max(conv)
        for small in sorted(conv)[:-1]:
            ratio = conv[large]["us_per_node"] / conv[small]["us_per_node"]
            cpu = conv[large]["cpu_us_per_node"] / conv[small]["cpu_us_per_node"]
            print(
                f"time/node at {large} vs {small} Convs: {ratio:.2f}x, CPU time/node {cpu:.2f}x "
                f"(target <= 1.5x; median of {args.repeat})"
            )
    for r in rows:
        if r["kind"] == "add":
            print(f"peak RSS of {r['nodes']} Adds: {r['peak_rss_mb']:.0f} MB (target <= 400 MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
