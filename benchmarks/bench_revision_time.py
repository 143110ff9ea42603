"""Quantize time of this checkout against an older revision, measured in the same run.

::

    python benchmarks/bench_revision_time.py --base 740763a [--repeats 3]
        [--models squeezenet,mobilenetv2]

The older revision is checked out into a temporary ``git worktree`` (removed at the end). Each
measurement is one child process that imports ``quark_onnx`` from one revision's sources (its
``passes`` folder mounted as ``quark_onnx.passes``, as the package installs it) and times
``ModelQuantizer.quantize_model`` with the XINT8 preset, from the call (which loads the model)
until the output file is written, on the 100 shared ImageNet calibration images pre-processed
once for both (``bench_accuracy.image_arrays``). The revisions alternate within each repeat
(base, head, base, head...), so load on the shared machine falls on both alike; the fastest of
the repeats is kept and the ratio is head / base (below 1.0: this checkout is faster). The
process CPU time of the same call (all threads) is reported beside the wall time: on a machine
shared with other work it varies less.

The quantized models of both revisions are compared byte for byte as well (a refactor must not
change them). Results: ``results/revision_time.json`` and ``results/revision_time.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))

MODELS = ("squeezenet", "mobilenetv2")


def _mount(root: Path) -> str:
    """Import ``quark_onnx`` from the sources under ``root`` (child process only); its file."""
    import importlib.util

    sys.path.insert(0, str(root))
    import quark_onnx

    if Path(quark_onnx.__file__).resolve().parent != (root / "quark_onnx").resolve():
        raise SystemExit(f"quark_onnx imported from {quark_onnx.__file__}, not {root}")
    # the installed package maps these two subpackages to the checkout's top-level folders, so
    # without this a revision would read the current passes and presets
    for sub in ("passes", "configs"):
        spec = importlib.util.spec_from_file_location(
            f"quark_onnx.{sub}",
            root / sub / "__init__.py",
            submodule_search_locations=[str(root / sub)],
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[f"quark_onnx.{sub}"] = module
        spec.loader.exec_module(module)
        setattr(quark_onnx, sub, module)
    return quark_onnx.__file__


def _child(root: Path, model: str, data: Path, out: Path) -> None:
    """Quantize ``model`` with the revision at ``root``; print one JSON line."""
    source = _mount(root)
    from bench_accuracy import MODELS as PATHS

    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

    x = np.load(data)
    name = {"squeezenet": "data_0", "mobilenetv2": "input"}[model]
    reader = ArrayDataReader({name: x}, batch_size=1)
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
    start, cpu = time.perf_counter(), time.process_time()
    quantizer.quantize_model(str(PATHS[model]), str(out), reader, progress=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    stages = dict(quantizer.report.timings)
    print(
        json.dumps(
            {"seconds": seconds, "cpu": cpu, "sha256": digest, "source": source, "stages": stages}
        )
    )


def _measure(root: Path, model: str, data: Path, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(root), model, str(data), str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{root} / {model} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="740763a", help="the older revision (a git commit)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--name", default="revision_time", help="results/<name>.json|md")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        root, model, data, out = args.child
        _child(Path(root), model, Path(data), Path(out))
        return 0

    from bench_accuracy import image_arrays

    models = [m for m in args.models.split(",") if m]
    head = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    base = _git("rev-parse", "--short", args.base)
    seconds: dict[str, dict[str, list[float]]] = {m: {"base": [], "head": []} for m in models}
    cpu: dict[str, dict[str, list[float]]] = {m: {"base": [], "head": []} for m in models}
    digests: dict[str, dict[str, str]] = {m: {} for m in models}
    stages: dict[str, dict[str, list[dict[str, float]]]] = {
        m: {"base": [], "head": []} for m in models
    }
    with tempfile.TemporaryDirectory(prefix="quark_onnx_rev_") as tmp:
        tmp_path = Path(tmp)
        worktree = tmp_path / "base"
        _git("worktree", "add", "--detach", str(worktree), base)
        try:
            data = {}
            for model in models:
                data[model] = tmp_path / f"{model}_calib.npy"
                np.save(data[model], image_arrays(model, "calib")[0])
            roots = {"base": worktree, "head": REPO}
            for repeat in range(args.repeats):
                for model in models:
                    # alternate which revision goes first, so neither always runs on a warm cache
                    order = ("base", "head") if repeat % 2 == 0 else ("head", "base")
                    for rev in order:
                        out = tmp_path / f"{model}_{rev}.onnx"
                        got = _measure(roots[rev], model, data[model], out)
                        seconds[model][rev].append(got["seconds"])
                        cpu[model][rev].append(got["cpu"])
                        digests[model][rev] = got["sha256"]
                        stages[model][rev].append(got.get("stages", {}))
                        print(
                            f"{model:12s} {rev:4s} {got['seconds']:7.2f} s "
                            f"(cpu {got['cpu']:7.2f} s)",
                            flush=True,
                        )
        finally:
            _git("worktree", "remove", "--force", str(worktree))
    rows = {}
    for model in models:
        b, h = min(seconds[model]["base"]), min(seconds[model]["head"])
        cb, ch = min(cpu[model]["base"]), min(cpu[model]["head"])
        rows[model] = {
            "base_s": round(b, 3),
            "head_s": round(h, 3),
            "ratio": round(h / b, 3),
            "base_cpu_s": round(cb, 3),
            "head_cpu_s": round(ch, 3),
            "cpu_ratio": round(ch / cb, 3),
            "base_runs": [round(s, 3) for s in seconds[model]["base"]],
            "head_runs": [round(s, 3) for s in seconds[model]["head"]],
            "same_output": digests[model]["base"] == digests[model]["head"],
            # per stage, the fastest over the repeats of each revision (stage names of the head)
            "stages": {
                name: {
                    rev: round(min(t.get(name, math.nan) for t in stages[model][rev]), 3)
                    for rev in ("base", "head")
                }
                for name in (stages[model]["head"][0] if stages[model]["head"] else {})
            },
        }
    result = {
        "base": base,
        "head": head + ("+uncommitted" if dirty else ""),
        "preset": "XINT8",
        "repeats": args.repeats,
        "calibration": "100 shared ImageNet calibration images, batch 1",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "models": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# Quantize time, XINT8: {result['head']} against {base} (same run)",
        "",
        f"Fastest of {args.repeats} interleaved runs per revision; "
        "`python benchmarks/bench_revision_time.py --base " + args.base + "`.",
        "",
        "| model | base s | head s | head / base | base CPU s | head CPU s | CPU head / base "
        "| same output bytes |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for model, r in rows.items():
        lines.append(
            f"| {model} | {r['base_s']:.2f} | {r['head_s']:.2f} | {r['ratio']:.3f} | "
            f"{r['base_cpu_s']:.2f} | {r['head_cpu_s']:.2f} | {r['cpu_ratio']:.3f} | "
            f"{'yes' if r['same_output'] else 'NO'} |"
        )
    lines += [
        "",
        "Per stage (report timings, fastest of the repeats of each revision; head / base):",
        "",
        "| model | stage | base s | head s | head / base |",
        "|---|---|---:|---:|---:|",
    ]
    for model, r in rows.items():
        for name, t in r["stages"].items():
            ratio = t["head"] / t["base"] if t["base"] else math.nan
            lines.append(f"| {model} | {name} | {t['base']:.3f} | {t['head']:.3f} | {ratio:.3f} |")
    (RESULTS / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
