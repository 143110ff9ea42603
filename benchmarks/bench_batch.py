"""Wall time of a batch of models: ``quark-onnx quantize --jobs 2`` against ``--ray`` (a local Ray
cluster of 2 CPUs), measured in the same run, interleaved, and what Ray's overhead is.

The batch: ``--models`` (default 8) variants of the shared models -- digits_cnn and SqueezeNet 1.1
alternating, each with its weights scaled by a different factor (so every model is quantized
anew, none is a byte copy of another) -- calibrated on ``--samples`` random samples each.

Measured, each ``--repeat`` times, interleaved (medians reported):

* ``jobs2``: the console script with ``--jobs 2`` (spawned processes);
* ``jobs2_omp1``: the same with ``OMP_NUM_THREADS=1`` in the environment, which Ray sets in
  every task of one CPU (numpy's BLAS then runs one thread per process instead of one per core);
* ``ray_cli``: the console script with ``--ray`` (it starts a local cluster of the machine's
  CPUs -- 2 here -- for the run and stops it: what a one-off command costs);
* ``jobs2_api``: the same batch runner (:func:`quark_onnx.cli.run_batch`, 2 processes) called in
  this process: ``jobs2`` without the console script's own start (interpreter and imports);
* ``ray_warm``: :func:`quark_onnx.cli.ray_runner.quantize_batch_on_ray` in this process, on a
  cluster of 2 CPUs started once beforehand (what a batch costs on a cluster that is already up: a
  nightly pipeline pointed at a running cluster with ``--ray ADDRESS``); its peer is
  ``jobs2_api``;
* ``ray_start``: starting and stopping that local cluster (``ray.init`` + ``ray.shutdown``);
* ``task_roundtrip``: 8 empty Ray tasks submitted and collected on the warm cluster;
* ``model_seconds_api`` / ``model_seconds_ray``: the sum over the models of each one's own time
  (:attr:`quark_onnx.cli.Outcome.seconds`, measured inside its worker) in ``jobs2_api`` /
  ``ray_warm``: how much of a difference is the per-model work rather than the scheduling;
* ``shards_K_BACKEND``: the calibrate stage of SqueezeNet 1.1 on ``--shard-samples`` random
  samples with ``calibration_shards=K`` (1; 2 processes; 2 Ray tasks on the warm cluster), from
  the report's stage timings; the models must be byte-identical.

Every variant's outputs are checked byte-identical to the ``jobs2`` outputs. Results:
``benchmarks/results/batch.{json,md}``.

    python benchmarks/bench_batch.py [--models 8] [--samples 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

REPO = Path(__file__).resolve().parents[1]
#: the benchmark models: $QUARK_ONNX_SHARED/models, else ../shared/models
SHARED = Path(os.environ.get("QUARK_ONNX_SHARED", REPO.parent / "shared")).resolve() / "models"
RESULTS = REPO / "benchmarks" / "results"
BASES = ("digits_cnn", "squeezenet1.1")


def make_batch(folder: Path, count: int) -> list[Path]:
    """``count`` models: the shared models alternating, float weights scaled by 1 + 0.01 i."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        base = BASES[i % len(BASES)]
        model = onnx.load(SHARED / f"{base}.onnx")
        for init in model.graph.initializer:
            if init.data_type == onnx.TensorProto.FLOAT:
                array = numpy_helper.to_array(init) * np.float32(1.0 + 0.01 * i)
                init.CopyFrom(numpy_helper.from_array(array.astype(np.float32), init.name))
        path = folder / f"{base}_v{i}.onnx"
        onnx.save(model, path)
        paths.append(path)
    return paths


def run_cli(
    models: Path, out: Path, samples: int, flag: list[str], env: dict[str, str] | None = None
) -> float:
    """Wall seconds of one console-script run (it must succeed)."""
    command = [sys.executable, "-m", "quark_onnx", "quantize", str(models), "-o", str(out)]
    command += ["--random-calib", str(samples), "--overwrite", "-q", *flag]
    start = time.perf_counter()
    environ = {**os.environ, **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=environ)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr}")
    return seconds


def calibrate_squeezenet(shards: int, backend: str, samples: int) -> tuple[float, bytes]:
    """Seconds of the calibrate stage of SqueezeNet (XINT8, random data) and the model bytes."""
    from quark_onnx import Config, ModelQuantizer, get_default_config

    qconfig = get_default_config("XINT8")
    qconfig.extra_options.update(UseRandomData=True, RandomDataSamples=samples)
    quantizer = ModelQuantizer(
        Config(global_quant_config=qconfig), calibration_shards=shards, shard_backend=backend
    )
    model = quantizer.quantize_model(SHARED / "squeezenet1.1.onnx", None, progress=False)
    return quantizer.report.timings["calibrate"], model.SerializeToString()


def same_outputs(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.glob("*.onnx"))
    return bool(names) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--shard-samples", type=int, default=64)
    args = parser.parse_args()

    import ray

    from quark_onnx.cli import Console, Job, QuantizeSettings, run_batch
    from quark_onnx.cli.ray_runner import quantize_batch_on_ray

    work = Path(tempfile.mkdtemp(prefix="bench_batch_"))
    try:
        models = work / "models"
        make_batch(models, args.models)
        times: dict[str, list[float]] = {
            "jobs2": [],
            "jobs2_omp1": [],
            "jobs2_api": [],
            "ray_cli": [],
            "ray_warm": [],
            "ray_start": [],
            "task_roundtrip": [],
            "model_seconds_api": [],
            "model_seconds_ray": [],
            "shards_1": [],
            "shards_2_processes": [],
            "shards_2_ray": [],
        }
        identical = True
        settings = QuantizeSettings(
            random_samples=args.samples, overwrite=True, log_level=logging.ERROR
        )
        for r in range(args.repeat):
            jobs_out = work / "jobs2"
            times["jobs2"].append(run_cli(models, jobs_out, args.samples, ["--jobs", "2"]))
            omp_out = work / "jobs2_omp1"
            omp1 = {"OMP_NUM_THREADS": "1"}
            seconds = run_cli(models, omp_out, args.samples, ["--jobs", "2"], omp1)
            times["jobs2_omp1"].append(seconds)
            identical &= same_outputs(jobs_out, omp_out)
            api_out = work / "jobs2_api"
            api_out.mkdir(exist_ok=True)
            jobs = [
                Job(index=i, model=str(m), name=m.stem, out_dir=str(api_out), settings=settings)
                for i, m in enumerate(sorted(models.glob("*.onnx")))
            ]
            start = time.perf_counter()
            outcomes = run_batch(jobs, 2, Console(len(jobs), io.StringIO()), False)
            times["jobs2_api"].append(time.perf_counter() - start)
            times["model_seconds_api"].append(sum(o.seconds for o in outcomes))
            assert all(o.ok for o in outcomes), [o.message for o in outcomes if not o.ok]
            identical &= same_outputs(jobs_out, api_out)
            ray_out = work / "ray_cli"
            times["ray_cli"].append(run_cli(models, ray_out, args.samples, ["--ray"]))
            identical &= same_outputs(jobs_out, ray_out)

            start = time.perf_counter()
            ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
            times["ray_start"].append(time.perf_counter() - start)
            try:
                noop = ray.remote(lambda: None)
                start = time.perf_counter()
                ray.get([noop.remote() for _ in range(8)])
                times["task_roundtrip"].append(time.perf_counter() - start)
                warm_out = work / "ray_warm"
                start = time.perf_counter()
                outcomes = quantize_batch_on_ray([models], warm_out, settings, stream=io.StringIO())
                times["ray_warm"].append(time.perf_counter() - start)
                times["model_seconds_ray"].append(sum(o.seconds for o in outcomes))
                assert all(o.ok for o in outcomes), [o.message for o in outcomes if not o.ok]
                identical &= same_outputs(jobs_out, warm_out)
                sharded = {}
                for key, k, backend in (
                    ("shards_1", 1, "processes"),
                    ("shards_2_processes", 2, "processes"),
                    ("shards_2_ray", 2, "ray"),
                ):
                    seconds, sharded[key] = calibrate_squeezenet(k, backend, args.shard_samples)
                    times[key].append(seconds)
                identical &= len(set(sharded.values())) == 1
            finally:
                start = time.perf_counter()
                ray.shutdown()
                times["ray_start"][-1] += time.perf_counter() - start
            print(
                f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "ray": ray.__version__,
        "models": args.models,
        "samples": args.samples,
        "repeat": args.repeat,
        "seconds": times,
        "median_seconds": med,
        "ray_cli_over_jobs2": med["ray_cli"] / med["jobs2"],
        "ray_warm_over_jobs2_api": med["ray_warm"] / med["jobs2_api"],
        "outputs_identical": identical,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "batch.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# Batch of {args.models} models: --jobs 2 vs --ray (local, 2 CPUs)",
        "",
        f"{result['date_utc']} UTC, {result['machine']}, ray {ray.__version__}; "
        f"{args.samples} random calibration samples per model; median of {args.repeat}, "
        "interleaved. Outputs byte-identical across runners: " + ("yes" if identical else "NO"),
        "",
        "| run | median wall s | ratio to its peer |",
        "|---|---|---|",
    ]
    peers = {
        "jobs2": "jobs2",
        "jobs2_omp1": "jobs2",
        "ray_cli": "jobs2",
        "jobs2_api": "jobs2_api",
        "ray_warm": "jobs2_api",
    }
    for key, peer in peers.items():
        lines.append(f"| {key} | {med[key]:.2f} | {med[key] / med[peer]:.2f}x {peer} |")
    lines += [
        "",
        f"Starting + stopping a local 2-CPU Ray cluster: {med['ray_start']:.2f} s; 8 empty tasks "
        f"round trip on a running one: {med['task_roundtrip'] * 1000:.0f} ms. Sum of the "
        f"models' own times (inside their workers): jobs2_api {med['model_seconds_api']:.1f} s, "
        f"ray_warm {med['model_seconds_ray']:.1f} s.",
        "",
        f"Calibrate stage of SqueezeNet 1.1, {args.shard_samples} random samples (models "
        "byte-identical): 1 shard "
        f"{med['shards_1']:.2f} s; 2 shards in processes {med['shards_2_processes']:.2f} s "
        f"({med['shards_2_processes'] / med['shards_1']:.2f}x); 2 shards as Ray tasks "
        f"{med['shards_2_ray']:.2f} s ({med['shards_2_ray'] / med['shards_1']:.2f}x).",
    ]
    (RESULTS / "batch.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
