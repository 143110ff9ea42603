"""Shared helpers of the benchmark: model/data catalogue, data preparation, measurement.

This module is imported by every runner, in every benchmark environment (the project venv,
``benchmarks/.envs/quark`` and ``benchmarks/.envs/bench``), so at import time it needs only the
standard library and numpy. Pillow (JPEG decoding), onnx (building the ResNet-50 stand-in) and
onnxruntime (accuracy, latency) are imported inside the functions that use them.

Data flow::

    python benchmarks/common.py prepare      # in the bench env: Pillow + onnx
        -> benchmarks/.work/data/<model>_calib.npy     float32, N x C x H x W
        -> benchmarks/.work/data/<model>_eval_x.npy    float32, M x C x H x W
        -> benchmarks/.work/data/<model>_eval_y.npy    int64 labels (absent: no labels)
        -> benchmarks/.work/data/resnet50_random.onnx  ResNet-50 with random weights

Every tool reads exactly these float arrays, so calibration and evaluation inputs are
bit-identical across tools.

ImageNet preprocessing (GUIDE section 4): Pillow decode, ``convert("RGB")``, resize so the
short side is 256 (bilinear), centre crop 224 x 224, then per model

* SqueezeNet 1.1: BGR channel order, 0..255 minus the Caffe mean (B, G, R) = (104, 117, 123);
* MobileNetV2: RGB, x / 255, minus mean (0.485, 0.456, 0.406), divided by std
  (0.229, 0.224, 0.225).

Measures:

* top-1: argmax of the flattened output against the label.
* SQNR (dB) of an output against the float model's output on the same inputs:
  ``10 log10(sum(ref^2) / sum((ref - out)^2))``.
* latency: median wall time of ``session.run`` on one batch-1 input, onnxruntime CPU,
  one intra-op thread, full graph optimisation (so QDQ pairs fuse into int8 kernels); the
  quantized and the float model are timed interleaved, and the ratio is taken from that pair.
* peak RSS: ``ru_maxrss`` of the child process (and its descendants), read with ``os.wait4``
  by a small launcher process, so it does not inherit the driver's memory; each runner also
  reports its own ``VmHWM`` as a cross-check.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
WORK_DIR = BENCH_DIR / ".work"
DATA_DIR = WORK_DIR / "data"
OUT_DIR = WORK_DIR / "out"
ENVS_DIR = BENCH_DIR / ".envs"
RESULTS_DIR = BENCH_DIR / "results"
SHARED_DIR = Path(os.environ.get("QUARK_ONNX_SHARED", REPO_DIR.parent / "shared")).resolve()
MODELS_DIR = SHARED_DIR / "models"
IMAGENET_DIR = SHARED_DIR / "data" / "imagenet"

IMAGENET_SHORT_SIDE = 256
IMAGENET_CROP = 224
RESNET50_CALIB = 32
RESNET50_EVAL = 16
RANDOM_SEED = 0

# The extra options AMD's Vitis AI documentation lists as mandatory for XINT8 with Quark
# (shared/seeds/004): applied to Quark and to onnxsim's Quark-compatible shim alike.
# UseRandomData is False here because the benchmark feeds real calibration data.
XINT8_EXTRA_OPTIONS: dict[str, bool] = {
    "UseRandomData": False,
    "ConvertBNToConv": True,
    "ConvertSigmoidToHardSigmoid": False,
    "ConvertClipToRelu": True,
    "SplitLargeKernelPool": False,
    "ReplaceClip6Relu": True,
    "ConvertReduceMeanToGlobalAvgPool": False,
    "RemoveQDQConvClip": False,
    "RemoveQDQConvPRelu": False,
    "RemoveQDQConvRelu": False,
    "RemoveQDQConvLeakyRelu": False,
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: where its float ONNX file is and how it is fed and scored."""

    name: str
    float_path: Path
    input_name: str
    description: str
    calib_source: str
    eval_source: str
    has_labels: bool

    @property
    def calib_path(self) -> Path:
        return DATA_DIR / f"{self.name}_calib.npy"

    @property
    def eval_x_path(self) -> Path:
        return DATA_DIR / f"{self.name}_eval_x.npy"

    @property
    def eval_y_path(self) -> Path:
        return DATA_DIR / f"{self.name}_eval_y.npy"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "digits_cnn",
            MODELS_DIR / "digits_cnn.onnx",
            "image",
            "MobileNet-style CNN on 8x8 digits upscaled to 32x32",
            "digits_calib.npz (200 images)",
            "digits_test.npz (719 images, labels)",
            True,
        ),
        ModelSpec(
            "squeezenet1.1",
            MODELS_DIR / "squeezenet1.1.onnx",
            "data_0",
            "SqueezeNet 1.1, ImageNet pretrained",
            "imagenet/calib (100 JPEGs)",
            "imagenet/val (500 JPEGs, labels)",
            True,
        ),
        ModelSpec(
            "mobilenetv2",
            MODELS_DIR / "mobilenetv2_rebuilt.onnx",
            "input",
            "MobileNetV2 1.0, ImageNet pretrained (rebuilt float)",
            "imagenet/calib (100 JPEGs)",
            "imagenet/val (500 JPEGs, labels)",
            True,
        ),
        ModelSpec(
            "resnet50",
            DATA_DIR / "resnet50_random.onnx",
            "gpu_0/data_0",
            "ResNet-50 (ONNX zoo light), random weights, opset 13, Sum->Add, final Softmax removed",
            f"{RESNET50_CALIB} random N(0,1) inputs",
            f"{RESNET50_EVAL} random N(0,1) inputs, SQNR of logits",
            False,
        ),
    )
}


# -- data preparation (bench environment: Pillow, onnx) ---------------------------------------


def _read_labels(folder: Path) -> list[tuple[str, int]]:
    """(file name, class index) rows of an ImageNet ``labels.txt``."""
    rows = []
    for line in (folder / "labels.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        rows.append((parts[0], int(parts[1])))
    return rows


def _decode_crop(path: Path) -> np.ndarray:
    """Decode one JPEG with Pillow: RGB, short side 256 (bilinear), centre crop 224. uint8 HWC."""
    from PIL import Image

    with Image.open(path) as img:
        img = img.convert("RGB")
        w, h = img.size
        scale = IMAGENET_SHORT_SIDE / min(w, h)
        nw, nh = max(IMAGENET_CROP, round(w * scale)), max(IMAGENET_CROP, round(h * scale))
        img = img.resize((nw, nh), Image.BILINEAR)
        left, top = (nw - IMAGENET_CROP) // 2, (nh - IMAGENET_CROP) // 2
        img = img.crop((left, top, left + IMAGENET_CROP, top + IMAGENET_CROP))
        return np.asarray(img, dtype=np.uint8)


def normalize_imagenet(crops: np.ndarray, model: str) -> np.ndarray:
    """uint8 N x H x W x 3 RGB crops -> float32 N x 3 x H x W, per the model's convention."""
    x = crops.astype(np.float32)
    if model == "squeezenet1.1":
        x = x[..., ::-1] - np.array([104.0, 117.0, 123.0], dtype=np.float32)  # BGR, Caffe mean
    elif model == "mobilenetv2":
        mean = np.array([0.485, 0.456, 0.406], dtype=np.float32)
        std = np.array([0.229, 0.224, 0.225], dtype=np.float32)
        x = (x / np.float32(255.0) - mean) / std
    else:
        raise ValueError(f"no ImageNet preprocessing for model {model!r}")
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)


def _build_resnet50(dst: Path) -> None:
    """Give the zoo-light ResNet-50 random weights, drop its final Softmax, convert to opset 13.

    The residual two-input ``Sum`` nodes are written as ``Add`` (the same function; modern
    exports of ResNet-50 use Add, and Quark leaves a Sum unquantized).

    Weights whose name ends in ``_w_0`` are He-normal (std sqrt(2 / fan_in)); BatchNorm scale
    U(0.5, 1), bias and running mean N(0, 0.1), running variance U(0.5, 1.5); other
    parameters N(0, 0.01). Fixed seed, so every run builds the same model.
    """
    import onnx
    from onnx import helper, numpy_helper, version_converter

    rng = np.random.default_rng(RANDOM_SEED)
    src = onnx.load(str(MODELS_DIR / "zoo_light" / "resnet50.onnx"))
    graph = src.graph
    data_input = graph.input[0].name
    inits = {t.name: t for t in graph.initializer}

    def random_tensor(name: str, shape: list[int]) -> onnx.TensorProto:
        base = name.removesuffix("_0")
        if base.endswith("_w"):
            fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            value = rng.normal(0.0, np.sqrt(2.0 / fan_in), shape)
        elif base.endswith("_bn_s"):
            value = rng.uniform(0.5, 1.0, shape)
        elif base.endswith(("_bn_b", "_bn_rm")):
            value = rng.normal(0.0, 0.1, shape)
        elif base.endswith("_bn_riv"):
            value = rng.uniform(0.5, 1.5, shape)
        else:
            value = rng.normal(0.0, 0.01, shape)
        return numpy_helper.from_array(value.astype(np.float32), name)

    new_inits: list[onnx.TensorProto] = []
    nodes = []
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in inits:
            shape = numpy_helper.to_array(inits[node.input[0]]).astype(int).tolist()
            new_inits.append(random_tensor(node.output[0], shape))
        elif node.op_type == "Sum" and len(node.input) == 2:
            # the residual adds: two-input Sum is Add, the op every quantizer handles
            nodes.append(helper.make_node("Add", list(node.input), list(node.output), node.name))
        else:
            nodes.append(node)
    for inp in graph.input[1:]:
        shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]
        if inp.name not in inits:
            new_inits.append(random_tensor(inp.name, shape))
    used = {name for node in nodes for name in node.input}
    new_inits += [t for t in graph.initializer if t.name in used and not t.name.endswith("__SHAPE")]
    softmax = nodes[-1]
    if softmax.op_type != "Softmax":
        raise RuntimeError("expected the zoo ResNet-50 to end with Softmax")
    nodes = nodes[:-1]
    logits = softmax.input[0]
    out = helper.make_tensor_value_info(logits, onnx.TensorProto.FLOAT, [1, 1000])
    new_graph = helper.make_graph(
        nodes, "resnet50_random", [graph.input[0]], [out], initializer=new_inits
    )
    model = helper.make_model(new_graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 7  # >= 4: initializers need not be graph inputs
    model = version_converter.convert_version(model, 13)
    model = onnx.shape_inference.infer_shapes(model)
    onnx.checker.check_model(model)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    if data_input != MODELS["resnet50"].input_name:
        raise RuntimeError(f"unexpected ResNet-50 input name {data_input!r}")


def prepare(force: bool = False) -> dict[str, Any]:
    """Write the cached inputs of every model under ``benchmarks/.work/data``. Idempotent."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {}
    digits = MODELS["digits_cnn"]
    if force or not digits.eval_y_path.exists():
        calib = np.load(MODELS_DIR / "digits_calib.npz")
        test = np.load(MODELS_DIR / "digits_test.npz")
        np.save(digits.calib_path, calib["x"].astype(np.float32))
        np.save(digits.eval_x_path, test["x"].astype(np.float32))
        np.save(digits.eval_y_path, test["y"].astype(np.int64))
    imagenet_models = ("squeezenet1.1", "mobilenetv2")
    if force or not all(MODELS[m].eval_y_path.exists() for m in imagenet_models):
        from PIL import __version__ as pil_version

        info["decoder"] = f"Pillow {pil_version}"
        for split, folder in (("calib", "calib"), ("eval", "val")):
            rows = _read_labels(IMAGENET_DIR / folder)
            crops = np.stack([_decode_crop(IMAGENET_DIR / folder / f) for f, _ in rows])
            labels = np.array([c for _, c in rows], dtype=np.int64)
            for m in imagenet_models:
                spec = MODELS[m]
                x = normalize_imagenet(crops, m)
                if split == "calib":
                    np.save(spec.calib_path, x)
                else:
                    np.save(spec.eval_x_path, x)
                    np.save(spec.eval_y_path, labels)
    resnet = MODELS["resnet50"]
    if force or not resnet.eval_x_path.exists() or not resnet.float_path.exists():
        _build_resnet50(resnet.float_path)
        rng = np.random.default_rng(RANDOM_SEED + 1)
        shape = (1, 3, 224, 224)
        np.save(resnet.calib_path, rng.standard_normal((RESNET50_CALIB, *shape[1:]), np.float32))
        np.save(resnet.eval_x_path, rng.standard_normal((RESNET50_EVAL, *shape[1:]), np.float32))
    for spec in MODELS.values():
        info[spec.name] = {
            "calib": list(np.load(spec.calib_path, mmap_mode="r").shape),
            "eval": list(np.load(spec.eval_x_path, mmap_mode="r").shape),
        }
    return info


# -- calibration data -------------------------------------------------------------------------


def calibration_batches(model: str) -> list[dict[str, np.ndarray]]:
    """The model's calibration set as a list of ``{input_name: 1 x C x H x W float32}``."""
    spec = MODELS[model]
    x = np.load(spec.calib_path)
    return [{spec.input_name: np.ascontiguousarray(x[i : i + 1])} for i in range(len(x))]


class ListReader:
    """Minimal onnxruntime-style calibration data reader over a list of feed dicts.

    ``get_next()`` returns the next dict, then ``None``; ``rewind()`` restarts (some tools read
    the data more than once). Runners wrap it in the tool's own reader base class where the
    tool insists on one.
    """

    def __init__(self, batches: list[dict[str, np.ndarray]]) -> None:
        self._batches = batches
        self._pos = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._pos >= len(self._batches):
            return None
        self._pos += 1
        return self._batches[self._pos - 1]

    def rewind(self) -> None:
        self._pos = 0

    def reset(self) -> None:
        self._pos = 0

    def __len__(self) -> int:
        return len(self._batches)


# -- runner side ------------------------------------------------------------------------------


def runner_args(tool: str) -> argparse.Namespace:
    """Arguments shared by every ``run_*.py`` runner."""
    p = argparse.ArgumentParser(description=f"Quantize one benchmark model with {tool}.")
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--out", required=True, type=Path, help="quantized model to write")
    p.add_argument("--result", required=True, type=Path, help="JSON file for the timings")
    return p.parse_args()


def peak_rss_mb() -> float:
    """Peak resident set size of this process image so far, in MiB.

    Reads ``VmHWM`` from ``/proc/self/status``, which starts afresh at exec (unlike
    ``ru_maxrss``, which keeps the parent's high-water mark across fork + exec).
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_tool(tool: str, description: str, prepare: Any) -> int:
    """The measurement every ``run_*.py`` runner shares; returns the process exit code.

    ``prepare(args, spec, imported)`` imports the tool, calls ``imported()`` right after its
    imports (so import time is reported apart), builds the reader and quantizer, and returns a
    callable that quantizes ``spec.float_path`` into ``args.out`` and may return extra result
    fields. Only that call is timed (wall and CPU); a tool that fails is recorded with its error
    text, never raised, so the driver can report it and go on.
    """
    args = runner_args(description)
    spec = MODELS[args.model]
    result: dict[str, Any] = {"tool": tool, "model": args.model, "ok": False}
    try:
        t0 = time.perf_counter()

        def imported() -> None:
            result["import_s"] = time.perf_counter() - t0

        quantize = prepare(args, spec, imported)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result["rss_before_quant_mb"] = peak_rss_mb()
        t1, c1 = time.perf_counter(), time.process_time()
        extra = quantize()
        if not args.out.exists():
            raise RuntimeError(f"{tool} returned without writing {args.out}")
        result["quant_s"] = time.perf_counter() - t1
        result["quant_cpu_s"] = time.process_time() - c1
        if isinstance(extra, dict):  # tools return their own objects; only dicts are results
            result.update(extra)
        result["vmhwm_mb"] = peak_rss_mb()
        result["ok"] = True
    except BaseException as exc:  # recorded, the driver reports it
        result["error"] = error_text(exc)
    write_result(args.result, result)
    return 0 if result["ok"] else 1


def write_result(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))


def error_text(exc: BaseException, limit: int = 2000) -> str:
    """The exception's type, message and traceback tail, trimmed for a JSON/markdown report."""
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text[-limit:]


# -- driver side ------------------------------------------------------------------------------


@dataclasses.dataclass
class ChildRun:
    """Outcome of one measured child process."""

    returncode: int | None
    wall_s: float
    cpu_s: float
    maxrss_mb: float
    stdout: str
    stderr: str
    timed_out: bool


# A minimal launcher, run with ``python -S``: it forks + execs the measured command and reports
# the command's own rusage. Linux carries a process's ``ru_maxrss`` high-water mark across fork
# and exec, so a child forked directly from the driver (which holds evaluation arrays and
# onnxruntime sessions) would report the driver's RSS as its peak; forked from this ~10 MiB
# launcher, the child's ``ru_maxrss`` is its own (and its descendants') peak.
_LAUNCHER = r"""
import json, os, signal, sys, time
report, timeout, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execv(argv[0], argv)
    finally:
        os._exit(127)
timed_out = False
while True:
    done, status, ru = os.wait4(pid, os.WNOHANG)
    if done == pid:
        break
    if time.perf_counter() - t0 > timeout:
        timed_out = True
        os.kill(pid, signal.SIGKILL)
        done, status, ru = os.wait4(pid, 0)
        break
    time.sleep(0.02)
wall = time.perf_counter() - t0
with open(report, "w") as f:
    json.dump({"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_kb": ru.ru_maxrss,
               "returncode": os.waitstatus_to_exitcode(status), "timed_out": timed_out}, f)
"""


def run_measured(
    cmd: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> ChildRun:
    """Run ``cmd``; return its exit code, wall time, CPU time and peak RSS (``ru_maxrss``).

    The command runs under a small launcher (see ``_LAUNCHER``) so that its ``ru_maxrss`` does
    not inherit the driver's memory. ``cmd[0]`` must be an executable path. stdout/stderr go to
    temporary files so a chatty tool cannot block on a full pipe.
    """
    import shutil
    import tempfile

    exe = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0]) or cmd[0]
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryDirectory() as tmp,
    ):
        report = Path(tmp) / "rusage.json"
        launcher = [sys.executable, "-S", "-c", _LAUNCHER, str(report), str(timeout_s)]
        t0 = time.perf_counter()
        proc = subprocess.run([*launcher, exe, *cmd[1:]], stdout=out, stderr=err, env=env, cwd=cwd)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
        if not report.exists():
            return ChildRun(proc.returncode, wall, 0.0, 0.0, stdout, stderr, False)
        ru = json.loads(report.read_text())
        return ChildRun(
            returncode=ru["returncode"],
            wall_s=ru["wall_s"],
            cpu_s=ru["cpu_s"],
            maxrss_mb=ru["maxrss_kb"] / 1024.0,
            stdout=stdout,
            stderr=stderr,
            timed_out=ru["timed_out"],
        )


def import_time(python: str, module: str, repeats: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Time ``import <module>`` in fresh interpreters (median of ``repeats``).

    Reports the import alone (perf_counter around the import statement) and the whole child
    process (interpreter start + import), each in seconds. ``warmup`` uncounted runs first fill
    the OS file cache and any first-use build (Quark compiles its custom ops on first import).
    """
    code = (
        "import time; t = time.perf_counter(); import "
        + module
        + "; print(time.perf_counter() - t)"
    )
    imports, walls = [], []
    error = None
    for _ in range(warmup):
        subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=900)
    for _ in range(repeats):
        t0 = time.perf_counter()
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            error = proc.stderr.strip()[-1000:]
            break
        imports.append(float(proc.stdout.strip().splitlines()[-1]))
        walls.append(wall)
    if error is not None:
        return {"module": module, "error": error}
    return {
        "module": module,
        "import_s": float(np.median(imports)),
        "process_s": float(np.median(walls)),
        "repeats": repeats,
    }


def sqnr_db(ref: np.ndarray, out: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``out`` against ``ref``, in dB."""
    ref = ref.astype(np.float64).ravel()
    noise = ref - out.astype(np.float64).ravel()
    den = float(np.sum(noise * noise))
    if den == 0.0:
        return float("inf")
    return float(10.0 * np.log10(float(np.sum(ref * ref)) / den))


def has_qdq(model: Any) -> bool:
    """Does ``model`` (a ModelProto, its bytes or a path) hold QuantizeLinear/DequantizeLinear?"""
    import onnx

    if isinstance(model, bytes):
        model = onnx.ModelProto.FromString(model)
    elif not hasattr(model, "graph"):
        model = onnx.load(str(model), load_external_data=False)
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def inference_session(model: Any, options: Any = None) -> Any:
    """An onnxruntime CPU session of ``model`` (a ModelProto, its bytes or a path).

    A model with Q/DQ nodes runs without graph optimisations, as ``quark_onnx.fidelity.compare``
    runs it, so its arithmetic is the one the ONNX specification gives its Q/DQ pairs. Optimised,
    onnxruntime quantizes the float weights of a ``DQ -> Conv -> Q`` unit itself (its
    WeightBiasQuantization rewrite): the ``activations only`` split of ``bench_error_sources``
    (float weights between quantized activations) ran with onnxruntime's int8 weights
    (``results/int8_bound.md``). A float model runs as ``options`` say (default: optimised).
    """
    import onnxruntime as ort

    if options is None:
        options = ort.SessionOptions()
        options.log_severity_level = 3
    if has_qdq(model):
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    data = model.SerializeToString() if hasattr(model, "SerializeToString") else model
    data = data if isinstance(data, bytes) else str(data)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def _options(threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


def _session(path: Path, threads: int = 1) -> Any:
    """A fully optimised session: latency is measured as a CPU user would run the model."""
    import onnxruntime as ort

    return ort.InferenceSession(str(path), _options(threads), providers=["CPUExecutionProvider"])


def model_outputs(path: Path, model: str) -> np.ndarray:
    """First output of the model on every evaluation input (batch 1), stacked: M x ..."""
    spec = MODELS[model]
    x = np.load(spec.eval_x_path)
    sess = inference_session(path, _options(threads=2))  # values: Q/DQ as specified
    name = sess.get_outputs()[0].name
    outs = [sess.run([name], {spec.input_name: x[i : i + 1]})[0] for i in range(len(x))]
    return np.concatenate(outs, axis=0)


def accuracy(outputs: np.ndarray, model: str) -> float | None:
    """Top-1 of the outputs against the model's labels, or None when it has none."""
    spec = MODELS[model]
    if not spec.has_labels:
        return None
    y = np.load(spec.eval_y_path)
    pred = outputs.reshape(len(outputs), -1).argmax(axis=1)
    return float(np.mean(pred == y))


def latency_ms(paths: list[Path], model: str, warmup: int = 5, runs: int = 30) -> list[float]:
    """Median latency (ms) of one batch-1 inference of each model, onnxruntime CPU, 1 thread.

    The models' runs are interleaved (A B A B ...), so a change in the machine's load during
    the measurement affects all of them alike and their ratio stays meaningful.
    """
    spec = MODELS[model]
    x = np.load(spec.eval_x_path, mmap_mode="r")
    feed = {spec.input_name: np.ascontiguousarray(x[0:1])}
    sessions = [_session(path, threads=1) for path in paths]
    for sess in sessions:
        for _ in range(warmup):
            sess.run(None, feed)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(runs):
        for i, sess in enumerate(sessions):
            t0 = time.perf_counter()
            sess.run(None, feed)
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t) * 1000.0) for t in times]


def git_commit() -> str:
    """The short hash of this checkout's HEAD (``unknown`` outside a git checkout), so that a
    results file names the code that produced it."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_DIR), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict[str, Any]:
    """Date, CPU, core count and memory of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_gb = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": mem_gb,
        "os": platform.platform(),
        "python": sys.version.split()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description="Benchmark data preparation.")
    p.add_argument("command", choices=["prepare"])
    p.add_argument("--force", action="store_true", help="rebuild the cached arrays")
    args = p.parse_args()
    if args.command == "prepare":
        print(json.dumps(prepare(force=args.force)))


if __name__ == "__main__":
    main()
