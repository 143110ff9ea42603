"""Benchmark quark_onnx against AMD Quark, onnxsim's Quark shim and onnxruntime's quantize_static.

One command runs everything (see benchmarks/README.md)::

    python benchmarks/bench_peers.py

Steps:

1. ``peers/setup_envs.sh`` creates the peer virtual environments under ``benchmarks/.envs``
   (skipped when they exist; ``--no-setup`` skips the step).
2. ``common.py prepare`` (bench env, Pillow) decodes the ImageNet JPEGs once and caches every
   model's calibration / evaluation inputs as ``.npy`` under ``benchmarks/.work/data``.
3. Import time of each tool, in fresh interpreters.
4. Each tool quantizes each model in its own child process (``run_*.py``); the driver reads the
   child's peak RSS (``ru_maxrss`` via ``os.wait4``) and the timings the runner writes.
5. In this process (onnxruntime of the project environment, the same for every tool): top-1 /
   top-1 drop, output SQNR against the float model, latency relative to the float model, and
   the verdict of ``quark_onnx.npu.readiness.check`` on every output (``n/a`` if not importable).
6. With ``--paired N``: per model, N more rounds in which every tool quantizes once, one after
   the other (the order alternating between rounds), and per peer the median over rounds of
   quark_onnx's time over the peer's in the same round (quantization wall time, and the whole
   child process's): a ratio measured under the same load, for a machine other work shares.
7. ``results/<name>.json``, ``results/<name>.md`` and ``results/<name>.png`` (the chart is drawn
   by this script's ``--plot`` mode in the bench env, which has matplotlib).

A tool that fails to install, import, quantize or run is recorded with its error text and
skipped; the benchmark itself does not fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common


@dataclasses.dataclass(frozen=True)
class Tool:
    """One quantizer under test: its runner script and the environment it runs in."""

    name: str
    label: str
    script: Path
    env: str | None  # benchmarks/.envs/<env>; None = the driver's own interpreter
    import_module: str
    packages: tuple[str, ...]

    def python(self, own_python: str) -> str:
        if self.env is None:
            return own_python
        return str(common.ENVS_DIR / self.env / "bin" / "python")


TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool(
            "quark_onnx",
            "quark_onnx XINT8 (+CLE, bias corr.)",
            common.BENCH_DIR / "run_quark_onnx.py",
            None,
            "quark_onnx",
            ("quark_onnx", "onnx", "onnxruntime", "onnx_ir", "onnxsim", "numpy"),
        ),
        Tool(
            "quark",
            "AMD Quark 0.13 XINT8",
            common.BENCH_DIR / "peers" / "run_quark.py",
            "quark",
            "quark.onnx",
            ("amd-quark", "torch", "onnx", "onnxruntime", "numpy"),
        ),
        Tool(
            "onnxsim_quark",
            "onnxsim.quark_compat XINT8",
            common.BENCH_DIR / "peers" / "run_onnxsim_quark.py",
            "bench",
            "onnxsim.quark_compat",
            ("onnxsim", "onnx", "onnxruntime", "numpy"),
        ),
        Tool(
            "ort_static",
            "onnxruntime quantize_static (float scales, per-channel)",
            common.BENCH_DIR / "peers" / "run_ort_static.py",
            "bench",
            "onnxruntime.quantization",
            ("onnxruntime", "onnx", "numpy"),
        ),
    )
}
PEERS = ("quark", "onnxsim_quark", "ort_static")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- environments and versions ----------------------------------------------------------------


def setup_envs(envs: set[str]) -> dict[str, str]:
    """Run setup_envs.sh for the wanted environments; return {env: error} for the failed ones."""
    if not envs:
        return {}
    script = common.BENCH_DIR / "peers" / "setup_envs.sh"
    proc = subprocess.run(["bash", str(script), *sorted(envs)], capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        log(line)
    failed = {}
    for env in envs:
        if not (common.ENVS_DIR / env / ".ready").exists():
            failed[env] = f"environment {env!r} failed to install (see benchmarks/.envs/{env}.log)"
    return failed


def _freeze(python: str) -> dict[str, str]:
    proc = subprocess.run(
        [python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {}
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(proc.stdout)}


def versions(tool: Tool, own_python: str) -> dict[str, str]:
    installed = _freeze(tool.python(own_python))
    return {p: installed.get(p.lower().replace("_", "-"), "not installed") for p in tool.packages}


# -- measurement ------------------------------------------------------------------------------


def quantize(tool: Tool, model: str, own_python: str, timeout_s: float) -> dict[str, Any]:
    """Run one tool on one model in a child process; return its timings, RSS and error."""
    out = common.OUT_DIR / tool.name / f"{model}.onnx"
    res_path = common.OUT_DIR / tool.name / f"{model}.json"
    out.unlink(missing_ok=True)
    res_path.unlink(missing_ok=True)
    cmd = [
        tool.python(own_python),
        str(tool.script),
        "--model",
        model,
        "--out",
        str(out),
        "--result",
        str(res_path),
    ]
    load_before = os.getloadavg()[0]
    # the tool's working directory is a scratch folder: Quark drops quantized_info.csv there
    workdir = common.OUT_DIR / tool.name
    workdir.mkdir(parents=True, exist_ok=True)
    run = common.run_measured(cmd, timeout_s=timeout_s, cwd=workdir)
    rec: dict[str, Any] = {
        "ok": False,
        "load_avg_1min_before": round(load_before, 2),
        "process_s": round(run.wall_s, 3),
        "process_cpu_s": round(run.cpu_s, 3),
        "peak_rss_mb": round(run.maxrss_mb, 1),
        "output": str(out.relative_to(common.REPO_DIR)),
    }
    if res_path.exists():
        rec.update(json.loads(res_path.read_text()))
    if run.timed_out:
        rec["ok"] = False
        rec["error"] = f"timed out after {timeout_s:.0f} s"
    elif not res_path.exists():
        rec["error"] = f"runner exited with {run.returncode} and no result: {run.stderr[-1500:]}"
    rec.pop("tool", None)
    rec.pop("model", None)
    return rec


def check_verdict(path: Path) -> dict[str, Any]:
    """``quark_onnx.npu.readiness.check(path)``: ready flag and findings, or n/a if not
    importable."""
    try:
        from quark_onnx.npu.readiness import check
    except Exception as exc:  # the checker is optional for the benchmark
        return {"ready": "n/a", "note": f"quark_onnx.check not importable: {exc}"}
    try:
        report = check(str(path))
        found = list(getattr(report, "findings", []))
        rules: dict[str, int] = {}
        for f in found:
            rule = str(getattr(f, "rule", type(f).__name__))
            rules[rule] = rules.get(rule, 0) + 1
        return {
            "ready": bool(report.ready),
            "rules": rules,
            "n_findings": len(found),
            "findings": [str(f) for f in found[:20]],
        }
    except Exception as exc:
        return {"ready": "error", "note": common.error_text(exc, 600)}


def evaluate(path: Path, model: str, float_eval: dict[str, Any] | None) -> dict[str, Any]:
    """Top-1, SQNR against the float outputs, latency (and ratio to float) of one model file."""
    import numpy as np

    outputs = common.model_outputs(path, model)
    rec: dict[str, Any] = {"top1": common.accuracy(outputs, model)}
    if float_eval is None:
        rec["latency_ms"] = round(common.latency_ms([path], model)[0], 3)
        rec["outputs"] = outputs
    else:
        spec = common.MODELS[model]
        q_ms, f_ms = common.latency_ms([path, spec.float_path], model)
        rec["latency_ms"] = round(q_ms, 3)
        rec["float_latency_ms"] = round(f_ms, 3)
        rec["latency_ratio"] = round(q_ms / f_ms, 3)
        ref = float_eval["outputs"]
        rec["sqnr_db"] = round(common.sqnr_db(ref, outputs), 2)
        if rec["top1"] is not None:
            rec["top1_drop_pp"] = round(100.0 * (float_eval["top1"] - rec["top1"]), 2)
            rec["top1_agreement"] = float(
                np.mean(
                    ref.reshape(len(ref), -1).argmax(1)
                    == outputs.reshape(len(outputs), -1).argmax(1)
                )
            )
    return rec


# -- report -----------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f", none: str = "–") -> str:
    if value is None:
        return none
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return format(value, spec)
    return str(value)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}x"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"# quark_onnx benchmark: {meta['name']}",
        "",
        f"- date: {meta['machine']['date']}",
        f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, "
        f"{meta['machine']['memory_gb']} GiB, {meta['machine']['os']}, "
        f"Python {meta['machine']['python']}",
        f"- command: `{meta['command']}` at commit {meta.get('commit', 'unknown')}",
        f"- total wall time: {meta['total_s']:.0f} s; quantization runs per tool and model: "
        f"{meta.get('repeat', 1)} (the fastest is reported)",
        f"- JPEG decoding: {meta.get('decoder', 'Pillow')} (short side 256 bilinear, centre "
        "crop 224), cached once as float32 .npy so every tool reads identical inputs",
        "- evaluation runtime (all tools): onnxruntime "
        f"{meta['eval_onnxruntime']} CPU; latency = median of 30 batch-1 runs, 1 intra-op "
        "thread, ORT_ENABLE_ALL; each quantized model is timed interleaved with its float model "
        "and latency / float is that pair's ratio",
        "",
        "## Versions",
        "",
        "| tool | environment | versions |",
        "|---|---|---|",
    ]
    for name, tool in results["tools"].items():
        vers = ", ".join(f"{k} {v}" for k, v in tool.get("versions", {}).items())
        lines.append(f"| {name} | {tool['env']} | {vers} |")
    lines += [
        "",
        "## Import time (fresh interpreter, median of 3 after one warm-up)",
        "",
        "| tool | module | import (s) | interpreter + import (s) |",
        "|---|---|---|---|",
    ]
    for name, tool in results["tools"].items():
        imp = tool.get("import", {})
        if "error" in imp:
            lines.append(f"| {name} | `{imp.get('module')}` | failed | {imp['error'][-200:]!r} |")
        else:
            lines.append(
                f"| {name} | `{imp.get('module')}` | {_fmt(imp.get('import_s'))} | "
                f"{_fmt(imp.get('process_s'))} |"
            )
    errors = []
    for model, mres in results["models"].items():
        spec = common.MODELS[model]
        flt = mres["float"]
        lines += [
            "",
            f"## {model}",
            "",
            f"{spec.description}. Calibration: {spec.calib_source}. Evaluation: "
            f"{spec.eval_source}. Float: top-1 {_fmt(flt.get('top1'), '.4f')}, latency "
            f"{_fmt(flt.get('latency_ms'))} ms.",
            "",
            "| tool | quant time (s) | quant CPU (s) | peak RSS (MiB) | top-1 | top-1 drop (pp) "
            "| output SQNR (dB) | latency (ms) | latency / float | checker ready | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, rec in mres["tools"].items():
            if not rec.get("ok"):
                lines.append(f"| {name} | **failed** (see below) | | | | | | | | | |")
                errors.append((model, name, rec.get("error", "unknown error")))
                continue
            chk = rec.get("check", {}).get("ready", "n/a")
            lines.append(
                f"| {name} | {_fmt(rec.get('quant_s'))} | {_fmt(rec.get('quant_cpu_s'))} "
                f"| {_fmt(rec.get('peak_rss_mb'), '.0f')} "
                f"| {_fmt(rec.get('top1'), '.4f')} | {_fmt(rec.get('top1_drop_pp'))} "
                f"| {_fmt(rec.get('sqnr_db'), '.1f')} | {_fmt(rec.get('latency_ms'))} "
                f"| {_fmt(rec.get('latency_ratio'))} | {chk} "
                f"| {_fmt(rec.get('load_avg_1min_before'), '.1f')} |"
            )
    lines += _checker_section(results)
    lines += _acceptance(results)
    lines += _paired_table(results)
    if errors:
        lines += ["", "## Failures", ""]
        for model, name, err in errors:
            lines += [f"### {name} on {model}", "", "```", err.strip()[-1500:], "```", ""]
    lines += [
        "",
        "Quantization time runs from just before the tool's quantize call (which loads the "
        "model) to the output file written; imports and reading the cached arrays are excluded "
        "and reported above. Peak RSS is the child process's `ru_maxrss` and includes the "
        "interpreter and the tool's imports (torch for Quark). Quant CPU is the process CPU "
        "time (all threads) over the same span, less sensitive to other load on the machine; "
        "load is the 1-minute load average when the run started. Top-1 drop is float minus "
        "quantized, in percentage points; output SQNR compares the quantized model's first "
        "output with the float model's on the evaluation inputs.",
        "",
    ]
    return "\n".join(lines)


def _checker_section(results: dict[str, Any]) -> list[str]:
    """Rule counts of ``quark_onnx.check`` per model and tool (full messages in the JSON)."""
    rows = []
    for model, mres in results["models"].items():
        for name, rec in mres["tools"].items():
            chk = rec.get("check")
            if not rec.get("ok") or not chk:
                continue
            if chk.get("ready") in ("n/a", "error"):
                rows.append(f"| {model} | {name} | {chk['ready']} | {chk.get('note', '')[:120]} |")
                continue
            rules = ", ".join(f"{k} ×{v}" for k, v in sorted(chk.get("rules", {}).items()))
            rows.append(f"| {model} | {name} | {chk['ready']} | {rules or 'none'} |")
    if not rows:
        return []
    return [
        "",
        "## quark_onnx.check on each output",
        "",
        "| model | tool | ready | findings by rule |",
        "|---|---|---|---|",
        *rows,
    ]


def _acceptance(results: dict[str, Any]) -> list[str]:
    """quark_onnx versus the peers, against the acceptance ratios of the project."""
    models = results["models"]
    tools = results["tools"]
    if "quark_onnx" not in tools:
        return []
    out = [
        "",
        "## quark_onnx versus the peers",
        "",
        "| model | time / Quark (≤ 0.25x) | time / onnxsim (≤ 0.5x) | peak RSS / Quark (≤ 0.6x) "
        "| peak RSS (MiB) |",
        "|---|---|---|---|---|",
    ]
    for model, mres in models.items():
        ours = mres["tools"].get("quark_onnx", {})
        quark = mres["tools"].get("quark", {})
        sim = mres["tools"].get("onnxsim_quark", {})
        if not ours.get("ok"):
            out.append(f"| {model} | ours failed | | | |")
            continue
        t, r = ours.get("quant_s"), ours.get("peak_rss_mb")
        out.append(
            f"| {model} | {_ratio(t, quark.get('quant_s') if quark.get('ok') else None)} "
            f"| {_ratio(t, sim.get('quant_s') if sim.get('ok') else None)} "
            f"| {_ratio(r, quark.get('peak_rss_mb') if quark.get('ok') else None)} "
            f"| {_fmt(r, '.0f')} |"
        )
    ours_imp = tools["quark_onnx"].get("import", {}).get("import_s")
    quark_imp = tools.get("quark", {}).get("import", {}).get("import_s")
    out += [
        "",
        f"Import: quark_onnx {_fmt(ours_imp)} s, Quark {_fmt(quark_imp)} s "
        f"(target: quark_onnx ≤ 1 s).",
    ]
    return out


def plot(results_path: Path, png: Path) -> None:
    """Accuracy drop (or output SQNR) versus quantization time, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    results = json.loads(results_path.read_text())
    models = list(results["models"])
    ncols = 2
    nrows = max(1, math.ceil(len(models) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(11, 4.2 * nrows), squeeze=False)
    markers = {"quark_onnx": "*", "quark": "o", "onnxsim_quark": "s", "ort_static": "^"}
    for ax, model in zip(axes.ravel(), models, strict=False):
        mres = results["models"][model]
        labels = common.MODELS[model].has_labels
        for name, rec in mres["tools"].items():
            if not rec.get("ok") or rec.get("quant_s") is None:
                continue
            y = rec.get("top1_drop_pp") if labels else rec.get("sqnr_db")
            if y is None:
                continue
            ax.scatter(rec["quant_s"], y, marker=markers.get(name, "o"), s=90, label=name)
            ax.annotate(
                f"{name}\n{rec.get('peak_rss_mb', 0):.0f} MiB",
                (rec["quant_s"], y),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=7,
            )
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.margins(x=0.3, y=0.2)
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("quantization time (s, log)")
        ax.set_ylabel(
            "top-1 drop (pp), lower is better" if labels else "logit SQNR (dB), higher is better"
        )
        ax.set_title(model)
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.ravel()[len(models) :]:
        ax.axis("off")
    meta = results["meta"]
    fig.suptitle(
        f"Accuracy vs quantization time ({meta['machine']['date'][:10]}, "
        f"{meta['machine']['cores']} cores {meta['machine']['cpu']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)


# -- driver -----------------------------------------------------------------------------------


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items() if k != "outputs"}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and math.isinf(obj):
        return "inf"
    return obj


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    own_python = sys.executable
    tools = [TOOLS[t] for t in args.tools]
    models = list(args.models)
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)

    env_errors: dict[str, str] = {}
    wanted_envs = {t.env for t in tools if t.env} | {"bench"}
    if not args.no_setup:
        log(f"setting up environments {sorted(wanted_envs)} (skipped when ready)")
        env_errors = setup_envs(wanted_envs)
    else:
        for env in wanted_envs:
            if not (common.ENVS_DIR / env / ".ready").exists():
                env_errors[env] = f"environment {env!r} missing (run peers/setup_envs.sh)"
    for err in env_errors.values():
        log(f"WARNING: {err}")

    bench_python = str(common.ENVS_DIR / "bench" / "bin" / "python")
    decoder = "Pillow"
    prep_python = bench_python if "bench" not in env_errors else own_python
    log(f"preparing cached inputs with {prep_python}")
    prep = subprocess.run(
        [prep_python, str(common.BENCH_DIR / "common.py"), "prepare"],
        capture_output=True,
        text=True,
    )
    if prep.returncode != 0:
        log(f"data preparation FAILED:\n{prep.stderr[-2000:]}")
        return 2
    prep_info = json.loads(prep.stdout.strip().splitlines()[-1])
    decoder = prep_info.get("decoder") or _pillow_version(prep_python)

    import onnxruntime

    results: dict[str, Any] = {
        "meta": {
            "name": args.name,
            "repeat": args.repeat,
            "machine": common.machine_info(),
            "command": " ".join(["python", *sys.argv]),
            "commit": common.git_commit(),
            "decoder": decoder,
            "eval_onnxruntime": onnxruntime.__version__,
            "data": {k: v for k, v in prep_info.items() if k != "decoder"},
        },
        "tools": {},
        "models": {},
    }
    usable: list[Tool] = []
    for tool in tools:
        entry: dict[str, Any] = {"label": tool.label, "env": tool.env or own_python}
        results["tools"][tool.name] = entry
        if tool.env in env_errors:
            entry["error"] = env_errors[tool.env]
            entry["import"] = {"module": tool.import_module, "error": env_errors[tool.env]}
            log(f"SKIP {tool.name}: {env_errors[tool.env]}")
            continue
        entry["versions"] = versions(tool, own_python)
        log(f"import time of {tool.import_module} ({tool.name})")
        entry["import"] = common.import_time(tool.python(own_python), tool.import_module)
        log(f"  {entry['import']}")
        usable.append(tool)

    for model in models:
        spec = common.MODELS[model]
        log(f"{model}: float baseline")
        float_eval = evaluate(spec.float_path, model, None)
        mres: dict[str, Any] = {"float": float_eval, "tools": {}}
        results["models"][model] = mres
        for tool in tools:
            if tool not in usable:
                mres["tools"][tool.name] = {
                    "ok": False,
                    "error": results["tools"][tool.name]["error"],
                }
                continue
            log(f"{model}: quantizing with {tool.name}")
            rec = quantize(tool, model, own_python, args.timeout)
            if rec.get("ok") and args.repeat > 1:
                rec = _best_of(rec, tool, model, own_python, args)
            if rec.get("ok"):
                try:
                    rec.update(evaluate(common.REPO_DIR / rec["output"], model, float_eval))
                except Exception as exc:
                    rec["ok"] = False
                    rec["error"] = "quantized model failed in onnxruntime: " + common.error_text(
                        exc
                    )
            if rec.get("ok"):
                rec["check"] = check_verdict(common.REPO_DIR / rec["output"])
            summary = {
                k: rec.get(k)
                for k in ("ok", "quant_s", "peak_rss_mb", "top1", "top1_drop_pp", "sqnr_db")
            }
            if not rec.get("ok"):
                summary["error"] = rec.get("error", "")[-300:]
            log(f"  {summary}")
            mres["tools"][tool.name] = rec
        if args.paired and "quark_onnx" in [t.name for t in usable]:
            mres["paired"] = paired_runs(usable, model, own_python, args)

    results["meta"]["total_s"] = time.perf_counter() - t_start
    results = _jsonable(results)
    json_path = common.RESULTS_DIR / f"{args.name}.json"
    md_path = common.RESULTS_DIR / f"{args.name}.md"
    png_path = common.RESULTS_DIR / f"{args.name}.png"
    json_path.write_text(json.dumps(results, indent=2))
    md_path.write_text(markdown(results))
    plot_python = bench_python if "bench" not in env_errors else own_python
    proc = subprocess.run(
        [plot_python, __file__, "--plot", str(json_path), str(png_path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        log(f"WARNING: chart not drawn: {proc.stderr[-500:]}")
    log(f"wrote {json_path}, {md_path}, {png_path} in {results['meta']['total_s']:.0f} s")
    return 0


def paired_runs(
    tools: list[Tool], model: str, own_python: str, args: argparse.Namespace
) -> dict[str, Any]:
    """``args.paired`` rounds of one quantization by every tool (order alternating); per peer the
    median of the rounds' ratios quark_onnx / peer (module doc, step 6)."""
    times: dict[str, list[tuple[float, float] | None]] = {t.name: [] for t in tools}
    for round_ in range(args.paired):
        order = tools if round_ % 2 == 0 else tools[::-1]
        for tool in order:
            rec = quantize(tool, model, own_python, args.timeout)
            ok = rec.get("ok") and rec.get("quant_s") is not None
            times[tool.name].append((rec["quant_s"], rec["process_s"]) if ok else None)
        log(f"{model}: paired round {round_ + 1}: { ({k: v[-1] for k, v in times.items()}) }")
    ours = times["quark_onnx"]
    out: dict[str, Any] = {"rounds": args.paired, "times": times, "ratios": {}}
    for name, theirs in times.items():
        if name == "quark_onnx":
            continue
        pairs = [(a, b) for a, b in zip(ours, theirs, strict=True) if a and b]
        if pairs:
            out["ratios"][name] = {
                "quant_s": round(statistics.median(a[0] / b[0] for a, b in pairs), 3),
                "process_s": round(statistics.median(a[1] / b[1] for a, b in pairs), 3),
                "pairs": len(pairs),
            }
    return out


def _paired_table(results: dict[str, Any]) -> list[str]:
    rows = [
        f"| {model} | {peer} | {r['quant_s']:.2f}x | {r['process_s']:.2f}x | {r['pairs']} |"
        for model, mres in results["models"].items()
        for peer, r in mres.get("paired", {}).get("ratios", {}).items()
    ]
    if not rows:
        return []
    return [
        "",
        "## Paired runs: quark_onnx time / peer time, median over rounds",
        "",
        "Each round quantizes with every tool once, back to back (order alternating), so both",
        "times of a ratio were taken under the same load. Targets: ≤ 1.2x onnxruntime's",
        "`quantize_static`, ≤ 0.25x AMD Quark.",
        "",
        "| model | peer | quantization wall | child process wall | rounds |",
        "|---|---|---:|---:|---:|",
        *rows,
    ]


def _best_of(
    first: dict[str, Any], tool: Tool, model: str, own_python: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Repeat a successful quantization; keep the fastest run, list every run's time and RSS."""
    runs = [first]
    for _ in range(args.repeat - 1):
        rec = quantize(tool, model, own_python, args.timeout)
        if rec.get("ok"):
            runs.append(rec)
    best = dict(min(runs, key=lambda r: r["quant_s"]))
    # the kept run's output file is the last one written; all runs produce the same model
    best["quant_s_runs"] = [round(r["quant_s"], 3) for r in runs]
    best["quant_cpu_s_runs"] = [round(r.get("quant_cpu_s", 0.0), 3) for r in runs]
    best["peak_rss_mb_runs"] = [r["peak_rss_mb"] for r in runs]
    best["quant_cpu_s"] = min(r.get("quant_cpu_s", math.inf) for r in runs)
    return best


def _pillow_version(python: str) -> str:
    proc = subprocess.run(
        [python, "-c", "import PIL; print(PIL.__version__)"], capture_output=True, text=True
    )
    return f"Pillow {proc.stdout.strip()}" if proc.returncode == 0 else "Pillow"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--tools",
        type=lambda s: s.split(","),
        default=list(TOOLS),
        help=f"comma-separated subset of {','.join(TOOLS)} (default: all)",
    )
    p.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=list(common.MODELS),
        help=f"comma-separated subset of {','.join(common.MODELS)} (default: all)",
    )
    p.add_argument("--name", default="benchmark", help="results/<name>.{json,md,png}")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per tool and model")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="quantize N times per tool and model, report the fastest (for a busy machine)",
    )
    p.add_argument(
        "--paired",
        type=int,
        default=0,
        help="N rounds of every tool back to back per model; median paired ratios (doc, step 6)",
    )
    p.add_argument("--no-setup", action="store_true", help="do not run peers/setup_envs.sh")
    p.add_argument("--plot", nargs=2, metavar=("RESULTS_JSON", "PNG"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.plot:
        plot(Path(args.plot[0]), Path(args.plot[1]))
        return 0
    for t in args.tools:
        if t not in TOOLS:
            p.error(f"unknown tool {t!r}; choose from {', '.join(TOOLS)}")
    for m in args.models:
        if m not in common.MODELS:
            p.error(f"unknown model {m!r}; choose from {', '.join(common.MODELS)}")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
