"""Big-model benchmark: quantize a generated model above 2 GB (external data) with XINT8.

Run from the repository root::

    python benchmarks/bench_big_model.py                 # 2.5 GB model, ~2.6 GB of weights
    python benchmarks/bench_big_model.py --gb 0.6        # quicker, below the protobuf limit
    python benchmarks/bench_big_model.py --gb 2.5 --keep /tmp/big   # keep the files
    python benchmarks/bench_big_model.py --keep /tmp/big --reuse    # rerun on the kept model

The model is a chain of square ``Gemm`` layers (``transB=1``, random N(0, 1/K) weights and small
biases) with a ``Relu`` after all but the last, input ``x`` of shape 1xK. It is generated one
weight at a time straight into ``big.onnx.data`` (never more than one weight matrix in memory),
so the size of the generator does not matter. A fresh subprocess then runs
``ModelQuantizer.quantize_model`` with the XINT8 preset on random calibration data
(``UseRandomData``, 2 samples) and writes the result; it reports the peak RSS of every stage of
the quantizer (:class:`StageMemory`: the kernel's ``VmHWM``, reset at each stage boundary, so
native allocations and touched memory-mapped pages count) and the stage timings, printed as a
markdown table. The target is a peak RSS of at most 3x the input model's size. A watchdog kills
the quantizer if its RSS goes above ``--max-rss-gb`` (default 16 GiB) to protect a shared
machine. The output is then checked: it names its data files by bare relative names inside the
output folder, and onnxruntime runs it.

This is a benchmark, not a test: it prints numbers (and a JSON line with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 1024**3


def generate(folder: Path, gb: float, k: int = 8192, seed: int = 0) -> tuple[Path, int]:
    """Write ``big.onnx`` + ``big.onnx.data`` (about ``gb`` GiB of float32 weights) to ``folder``.

    Returns the model path and the total size in bytes of the model and its data.
    """
    import numpy as np
    from onnx import TensorProto, helper

    layers = max(1, round(gb * GIB / (k * k * 4)))
    model_path = folder / "big.onnx"
    data_name = model_path.name + ".data"
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    offset = 0
    with open(folder / data_name, "wb") as f:

        def external(name: str, array: np.ndarray) -> TensorProto:
            nonlocal offset
            pad = -offset % 4096
            f.write(b"\0" * pad)
            offset += pad
            data = array.astype("<f4").tobytes()
            f.write(data)
            t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(array.shape))
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", offset), ("length", len(data))):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            offset += len(data)
            return t

        current = "x"
        for i in range(layers):
            w = rng.standard_normal((k, k), dtype=np.float32) * np.float32(1.0 / np.sqrt(k))
            inits.append(external(f"w{i}", w))
            del w
            inits.append(external(f"b{i}", rng.standard_normal(k, dtype=np.float32) * 0.01))
            out = f"gemm{i}" if i < layers - 1 else "y"
            nodes.append(
                helper.make_node(
                    "Gemm", [current, f"w{i}", f"b{i}"], [out], name=f"gemm{i}", transB=1
                )
            )
            current = out
            if i < layers - 1:
                nodes.append(helper.make_node("Relu", [out], [f"relu{i}"], name=f"relu{i}"))
                current = f"relu{i}"
    graph = helper.make_graph(
        nodes,
        "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, k])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model_path.write_bytes(model.SerializeToString())
    size = model_path.stat().st_size + (folder / data_name).stat().st_size
    return model_path, size


class StageMemory:
    """Peak RSS per quantizer stage, from the kernel's high-water mark.

    At each stage boundary ``VmHWM`` is read (the peak since the previous boundary) and reset to
    the current RSS by writing ``5`` to ``/proc/self/clear_refs``, so every stage gets its own
    exact peak, native allocations (protobuf, onnxruntime) and touched memory-mapped pages
    included. Memory used between two stages is reported under ``"(before <stage>)"``. A thread
    also samples ``RssAnon``/``RssFile`` every 20 ms to tell heap from mapped file pages (those
    two are sampled maxima and may miss a short peak). Each stage is also written to stderr as it
    ends, so a run stopped by the watchdog still shows where the memory went.
    """

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, int]] = {}
        self._sampled = {"RssAnon": 0, "RssFile": 0}
        self._stop = False
        self._thread = None

    @staticmethod
    def _status() -> dict[str, int]:
        values = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    values[key] = int(rest.split()[0]) * 1024
        return values

    @staticmethod
    def _reset_peak() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def _sample(self) -> None:
        while not self._stop:
            status = self._status()
            for key in self._sampled:
                self._sampled[key] = max(self._sampled[key], status.get(key, 0))
            time.sleep(0.02)

    def start(self) -> None:
        import threading

        self._reset_peak()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def boundary(self, name: str) -> None:
        """Close the interval that ends now under ``name`` (its peak and sampled maxima)."""
        status = self._status()
        record = {
            "peak": status["VmHWM"],
            "end": status["VmRSS"],
            "anon": max(self._sampled["RssAnon"], status["RssAnon"]),
            "file": max(self._sampled["RssFile"], status["RssFile"]),
        }
        self.stages[name] = record
        sys.stderr.write(
            f"stage {name:<24} peak {record['peak'] / GIB:6.2f} GiB  end "
            f"{record['end'] / GIB:6.2f} GiB  (anon {record['anon'] / GIB:.2f}, file "
            f"{record['file'] / GIB:.2f})\n"
        )
        sys.stderr.flush()
        self._reset_peak()
        self._sampled = {"RssAnon": 0, "RssFile": 0}

    def patch(self, module) -> None:
        """Wrap ``module._stage`` (the quantizer's stage timer) with :meth:`boundary` calls."""
        from contextlib import contextmanager

        timed = module._stage

        @contextmanager
        def stage(report, name):
            self.boundary(f"(before {name})")
            with timed(report, name):
                yield
            self.boundary(name)

        module._stage = stage

    @property
    def peak(self) -> int:
        return max((r["peak"] for r in self.stages.values()), default=0)


def _quantize_child(model: str, output: str) -> None:
    """Runs in the subprocess: quantize and print one JSON line with peak RSS and timings."""
    import quark_onnx
    from quark_onnx import Config, ModelQuantizer, get_default_config
    from quark_onnx.pipeline import quantizer as quantizer_module

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    memory = StageMemory()
    memory.patch(quantizer_module)
    qc = get_default_config("XINT8")
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=2)
    memory.start()
    start = time.perf_counter()
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.quantize_model(model, output)
    seconds = time.perf_counter() - start
    memory.boundary("(after save)")
    print(
        json.dumps(
            {
                "peak_rss": memory.peak,
                "seconds": seconds,
                "timings": quantizer.report.timings,
                "stages": memory.stages,
                "package": quark_onnx.__file__,
            }
        )
    )


def verify(output: Path) -> dict:
    """Files of the quantized model (all inside its folder) and one onnxruntime run."""
    import numpy as np
    import onnxruntime as ort

    from quark_onnx.model_files.save import written_files

    files = written_files(output)
    inside = all(f.resolve().parent == output.resolve().parent for f in files)
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    spec = session.get_inputs()[0]
    x = np.random.default_rng(1).random([d if isinstance(d, int) else 1 for d in spec.shape])
    y = session.run(None, {spec.name: x.astype(np.float32)})[0]
    return {
        "files": [f.name for f in files],
        "output_bytes": sum(f.stat().st_size for f in files),
        "inside_output_folder": inside,
        "runs": bool(np.isfinite(y).all()),
    }


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run_watched(cmd: list[str], max_rss_gb: float) -> tuple[int, str, str, int]:
    """Run ``cmd``; kill it if its RSS goes above ``max_rss_gb`` (protects a shared machine).

    Returns the exit code, stdout, stderr and the highest RSS seen by polling.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        highest = 0
        while proc.poll() is None:
            highest = max(highest, _rss_bytes(proc.pid))
            if highest > max_rss_gb * GIB:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), highest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.5, help="weights to generate, GiB")
    parser.add_argument("--k", type=int, default=8192, help="Gemm width (weights are k x k)")
    parser.add_argument("--keep", type=Path, help="folder to generate into and keep")
    parser.add_argument(
        "--reuse", action="store_true", help="with --keep: use the model already there"
    )
    parser.add_argument("--json", action="store_true", help="also print a JSON line")
    parser.add_argument(
        "--max-rss-gb", type=float, default=16.0, help="kill the quantizer above this RSS, GiB"
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _quantize_child(*args.child)
        return

    with tempfile.TemporaryDirectory(prefix="quark_onnx_big_") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        model = folder / "big.onnx"
        if args.reuse and model.exists():
            size = model.stat().st_size + (folder / "big.onnx.data").stat().st_size
        else:
            model, size = generate(folder, args.gb, args.k)
        generated = time.perf_counter() - start
        outdir = folder / "out"
        outdir.mkdir(exist_ok=True)
        output = outdir / "big.quant.onnx"
        returncode, stdout, stderr, watched = _run_watched(
            [sys.executable, __file__, "--child", str(model), str(output)], args.max_rss_gb
        )
        if returncode != 0:
            sys.stderr.write(stderr[-4000:])
            sys.stderr.write("".join(_stage_lines(stderr)))
            if watched > args.max_rss_gb * GIB:
                raise SystemExit(
                    f"stopped: the quantizer's RSS reached {watched / GIB:.2f} GiB "
                    f"({watched / size:.2f}x the model), above --max-rss-gb {args.max_rss_gb}"
                )
            raise SystemExit(
                f"quantization failed with exit code {returncode}; highest RSS seen "
                f"{watched / GIB:.2f} GiB ({watched / size:.2f}x the model)"
            )
        child = json.loads(stdout.strip().splitlines()[-1])
        result = {
            "model_bytes": size,
            "generate_seconds": round(generated, 1),
            "quantize_seconds": round(child["seconds"], 1),
            "peak_rss_bytes": child["peak_rss"],
            "peak_rss_over_model": round(child["peak_rss"] / size, 2),
            "timings": child["timings"],
            "stages": child["stages"],
            **verify(output),
        }
    print(f"model size     {size / GIB:.2f} GiB ({size} bytes, {args.k}x{args.k} Gemm layers)")
    print(f"generate       {result['generate_seconds']} s")
    print(f"quantize       {result['quantize_seconds']} s  stages: {result['timings']}")
    print(
        f"peak RSS       {child['peak_rss'] / GIB:.2f} GiB = "
        f"{result['peak_rss_over_model']}x the model (target <= 3x)"
    )
    print(
        f"output         {result['output_bytes'] / GIB:.2f} GiB in {result['files']}; inside the "
        f"output folder: {result['inside_output_folder']}; onnxruntime runs it: {result['runs']}"
    )
    print(f"package        {child['package']}")
    print()
    print(stage_table(child["stages"], child["timings"], size))
    if args.json:
        print(json.dumps(result))


def _stage_lines(stderr: str) -> list[str]:
    return [line + "\n" for line in stderr.splitlines() if line.startswith("stage ")]


def stage_table(stages: dict[str, dict[str, int]], timings: dict[str, float], size: int) -> str:
    """Markdown table: per stage, seconds, peak RSS (GiB and x model size), RSS at its end."""
    rows = [
        "| stage | s | peak RSS GiB | peak / model | end RSS GiB | anon / file max GiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in stages.items():
        seconds = timings.get(name, "")
        rows.append(
            f"| {name} | {seconds} | {r['peak'] / GIB:.2f} | {r['peak'] / size:.2f} | "
            f"{r['end'] / GIB:.2f} | {r['anon'] / GIB:.2f} / {r['file'] / GIB:.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
