"""Fidelity benchmark: does XINT8 keep the float model's behaviour on every shared model?

Run from the repository root (project environment)::

    python benchmarks/bench_fidelity.py                               # everything, both configs
    python benchmarks/bench_fidelity.py --models squeezenet,squeezenet_both --configs preset
    python benchmarks/bench_fidelity.py --rerun                       # also byte-identical reruns
    python benchmarks/bench_fidelity.py --techniques                  # each preset technique off
    python benchmarks/bench_fidelity.py --name fidelity_baseline      # results file name

Models (``--models``, comma separated; ``all`` by default):

* ``digits``, ``squeezenet``, ``mobilenetv2``: data exactly as ``bench_accuracy.py`` loads and
  caches it (``dataset()``): digits 200 calibration / 719 test images; ImageNet models the 100
  images of ``data/imagenet/calib`` / the 500 of ``data/imagenet/val``;
* ``<model>_rescale``, ``<model>_deadconst``, ``<model>_both`` for those three: stress variants
  written by ``make_stress_variants.py`` (seed 0, checked float-exact on calibration images) under
  ``benchmarks/.work/fidelity/``; their top-1 drop is measured from the **original** float model;
* ``person``: ``person_detector_192.onnx`` (GUIDE section 4): each image letterboxed to 192 x 192
  (resize keeping aspect so the long side is 192, bilinear, pasted top-left on a canvas of 114),
  BGR 0..255; output ``1 x 756 x 6`` decoded on the 24/12/6 grids of strides 8/16/32 (``x, y =
  (out + cell) * stride``, ``w, h = exp(out) * stride``, score = objectness x person score > 0.3,
  NMS at IoU 0.45). Fidelity: the share of the float model's detections that a quantized
  detection matches at IoU >= 0.5 (one-to-one, greedy by float score);
* ``ppocr``: ``ppocr_direction_cls.onnx`` with its input fixed to ``1 x 3 x 48 x 192``: from each
  image the centred full-width band of height ``W / 3`` (a text-line-shaped crop) resized to
  height 48 keeping aspect (width ``ceil(48 * w / h)``, at most 192), BGR, ``(x / 255 - 0.5) /
  0.5``, right-padded with 0 to width 192 (PaddleOCR's ``resize_norm_img``). Fidelity: NaN/Inf in
  the output, output SQNR, argmax agreement.

Person detector and OCR calibrate on the same 100 calibration JPEGs with their own
pre-processing and are tested on the 500 val JPEGs. JPEGs are decoded with onnxruntime-extensions'
``DecodeImage`` and resized in numpy (half-pixel bilinear, no antialiasing); the arrays are cached
in ``benchmarks/.work/fidelity/`` (never in the repository).

Option sets (``--configs``): ``preset`` is ``get_default_config("XINT8")`` as shipped; ``seed`` is
the Vitis AI documentation's snippet as written (``shared/seeds/004``): the preset with
``activation_type = QInt8``, ``optimize_model = False`` and its extra options (``UseRandomData``
included), with the real calibration reader passed as well. A given reader wins over
``UseRandomData`` (README: random data only when no data is given), so ``seed`` calibrates on the
real images, with a warning; ``seed_real`` is the same snippet with ``UseRandomData = False``
(how ``bench_peers.py`` runs Quark with the snippet, ``common.XINT8_EXTRA_OPTIONS``) and should
measure the same.

Measured per model and option set: top-1 of the quantized model and its drop in points from the
original float model (labelled models), per graph output the SQNR ``10 log10(sum f^2 / sum (f -
q)^2)`` over all test images and the mean per-image cosine, top-1 (argmax) agreement with float,
NaN/Inf, detection match (person), quantization wall time, whether ``quark_onnx.check`` finds the
output Vitis AI-ready, and with ``--rerun`` whether a second quantization writes identical bytes.
Quantized models run in onnxruntime CPU with default optimisations (as deployed).

``--techniques``: for each model, output SQNR with the preset against the preset with one of its
techniques turned off, for every technique the preset enables. The list is discovered from the
preset (``include_*`` fields and ``optimize_model`` that are on, and every boolean extra option
that is on), leaving out what defines the format or the NPU's arithmetic rather than an accuracy
technique (``FORMAT_OPTIONS``, the ``Align*``/``Adjust*`` NPU rules and the DPU simulation).
A technique "lowers SQNR" where turning it off raises SQNR.

Results: a text table and JSON in ``benchmarks/results/<name>.{txt,json}`` (``--name``, default
``fidelity``). Rows of an earlier run of the same name are kept unless a new row replaces them
(same model, option set and mode), so ``--models``/``--configs`` reruns update a part.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from quark_onnx.npu.readiness import check

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_accuracy  # data loading and caching of the classifiers
import common
import make_stress_variants

WORK = common.WORK_DIR / "fidelity"
SHARED_MODELS = bench_accuracy.SHARED / "models"
IMAGENET = bench_accuracy.SHARED / "data" / "imagenet"

CLASSIFIERS = ("digits", "squeezenet", "mobilenetv2")
VARIANT_KINDS = ("rescale", "deadconst", "both")
VARIANT_SEED = 0
BASE_MODELS = (*CLASSIFIERS, "person", "ppocr")
ALL_MODELS = (
    *CLASSIFIERS,
    *(f"{m}_{k}" for m in CLASSIFIERS for k in VARIANT_KINDS),
    "person",
    "ppocr",
)
CONFIGS = ("preset", "seed", "seed_real")
# --techniques: the preset row measured in the same run (its key differs from the main rows').
REFERENCE = "none"

# shared/seeds/004: the options the Vitis AI documentation calls mandatory for XINT8.
SEED_EXTRA_OPTIONS: dict[str, bool] = {**common.XINT8_EXTRA_OPTIONS, "UseRandomData": True}

# Boolean options that define the format or the NPU's arithmetic, not an accuracy technique:
# turning them off measures another target, not a technique.
FORMAT_OPTIONS = frozenset(
    {
        "ActivationSymmetric",
        "WeightSymmetric",
        "QuantizeBias",
        "Int32Bias",
        "WeightsOnly",
        "UseRandomData",
        "SimulateDPU",
        "CLEScaleAppendBias",  # a parameter of CLE, meaningful only with include_cle
        "LayerErrorAnalysis",  # a report, not a change to the model
    }
)
NPU_RULE_PREFIXES = ("Align", "Adjust", "Convert")  # "Convert...ToDPUVersion" only, see below

# Person detector (GUIDE section 4).
DET_SIZE = 192
DET_PAD = 114.0
DET_STRIDES = (8, 16, 32)
DET_SCORE = 0.3
DET_NMS_IOU = 0.45
DET_MATCH_IOU = 0.5
# PaddleOCR direction classifier input.
OCR_H, OCR_W = 48, 192
OCR_BAND_ASPECT = 3.0


# -- images (numpy; the package's image reader is not used here) ------------------------------


def _decoder():
    """An onnxruntime session that decodes one JPEG/PNG to H x W x 3 uint8 RGB."""
    import onnxruntime as ort
    import onnxruntime_extensions
    from onnx import TensorProto, helper

    major, minor = (int(p) for p in onnxruntime_extensions.__version__.split(".")[:2])
    if (major, minor) < (0, 15):  # older releases ignore color_space and give BGR
        raise SystemExit("bench_fidelity needs onnxruntime-extensions >= 0.15")
    node = helper.make_node(
        "DecodeImage", ["b"], ["img"], domain="com.microsoft.extensions", color_space="rgb"
    )
    graph = helper.make_graph(
        [node],
        "decode",
        [helper.make_tensor_value_info("b", TensorProto.UINT8, ["n"])],
        [helper.make_tensor_value_info("img", TensorProto.UINT8, None)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", 17),
            helper.make_opsetid("com.microsoft.extensions", 1),
        ],
    )
    model.ir_version = 8
    options = ort.SessionOptions()
    options.register_custom_ops_library(onnxruntime_extensions.get_library_path())
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )

    def decode(path: Path) -> np.ndarray:
        (img,) = session.run(None, {"b": np.frombuffer(path.read_bytes(), np.uint8)})
        img = np.asarray(img)
        if img.ndim == 2:
            img = img[..., None]
        if img.shape[2] == 1:
            img = np.repeat(img, 3, axis=2)
        return img[..., :3]

    return decode


def resize_bilinear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Half-pixel bilinear resize of H x W x C (as OpenCV's INTER_LINEAR; no antialiasing)."""
    h, w = img.shape[:2]
    x = img.astype(np.float32)

    def axis(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        u = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
        u = np.clip(u, 0.0, n_in - 1)
        i0 = np.floor(u).astype(np.int64)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, (u - i0).astype(np.float32)

    y0, y1, fy = axis(h, out_h)
    x0, x1, fx = axis(w, out_w)
    rows = x[y0] * (1 - fy)[:, None, None] + x[y1] * fy[:, None, None]
    return rows[:, x0] * (1 - fx)[None, :, None] + rows[:, x1] * fx[None, :, None]


def letterbox(rgb: np.ndarray) -> np.ndarray:
    """Person detector input: 3 x 192 x 192 BGR 0..255, resized into the top-left corner."""
    h, w = rgb.shape[:2]
    r = min(DET_SIZE / h, DET_SIZE / w)
    nh, nw = int(h * r), int(w * r)
    canvas = np.full((DET_SIZE, DET_SIZE, 3), DET_PAD, dtype=np.float32)
    canvas[:nh, :nw] = resize_bilinear(rgb[..., ::-1], nh, nw)
    return canvas.transpose(2, 0, 1)


def ocr_crop(rgb: np.ndarray) -> np.ndarray:
    """PaddleOCR classifier input: 3 x 48 x 192 from the image's centred text-line band."""
    h, w = rgb.shape[:2]
    band = max(1, min(h, round(w / OCR_BAND_ASPECT)))
    top = (h - band) // 2
    crop = rgb[top : top + band, :, ::-1]  # BGR
    rw = min(OCR_W, math.ceil(OCR_H * w / band))
    x = resize_bilinear(crop, OCR_H, rw) / np.float32(255.0)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    out = np.zeros((3, OCR_H, OCR_W), dtype=np.float32)
    out[:, :, :rw] = x.transpose(2, 0, 1)
    return out


def image_set(model: str, split: str) -> np.ndarray:
    """``person``/``ppocr`` inputs for ``data/imagenet/<split>`` (cached), N x 3 x H x W."""
    cache = WORK / f"{model}_{split}.npy"
    if cache.exists():
        return np.load(cache)
    folder = IMAGENET / split
    files = list(bench_accuracy.read_labels(folder / "labels.txt"))
    decode = _decoder()
    prep = letterbox if model == "person" else ocr_crop
    x = np.stack([prep(decode(folder / f)) for f in files]).astype(np.float32)
    WORK.mkdir(parents=True, exist_ok=True)
    np.save(cache, x)
    return x


# -- models -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Entry:
    """One benchmark model: its float file, data, and the original it was derived from."""

    name: str
    base: str  # the shared model it derives from (itself for shared models)
    task: str  # classifier | detector | ocr
    float_path: Path
    calib: np.ndarray
    test: np.ndarray
    labels: np.ndarray | None


def _ppocr_static() -> Path:
    """The OCR classifier with its input fixed to 1 x 3 x 48 x 192 (float-identical)."""
    import onnx

    path = WORK / "ppocr_direction_cls_1x3x48x192.onnx"
    if path.exists():
        return path
    model = onnx.load(str(SHARED_MODELS / "ppocr_direction_cls.onnx"))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for dim, value in zip(dims, (1, 3, OCR_H, OCR_W), strict=True):
        dim.Clear()
        dim.dim_value = value
    out_dims = model.graph.output[0].type.tensor_type.shape.dim
    out_dims[0].Clear()
    out_dims[0].dim_value = 1
    WORK.mkdir(parents=True, exist_ok=True)
    make_stress_variants.write_atomic(model, path)
    return path


def _variant(base: str, kind: str) -> Path:
    path = WORK / f"{base}_{kind}_seed{VARIANT_SEED}.onnx"
    if not path.exists():
        make_stress_variants.build(
            bench_accuracy.MODELS[base], kind, VARIANT_SEED, path, samples=16
        )
    return path


def load_entry(name: str) -> Entry:
    base, _, kind = name.partition("_")
    if base in CLASSIFIERS:
        cx, tx, ty = bench_accuracy.dataset(base)
        path = _variant(base, kind) if kind else bench_accuracy.MODELS[base]
        return Entry(name, base, "classifier", Path(path), cx, tx, np.asarray(ty))
    if name == "person":
        return Entry(
            name,
            name,
            "detector",
            SHARED_MODELS / "person_detector_192.onnx",
            image_set("person", "calib"),
            image_set("person", "val"),
            None,
        )
    if name == "ppocr":
        return Entry(
            name, name, "ocr", _ppocr_static(), image_set("ppocr", "calib"),
            image_set("ppocr", "val"), None,
        )  # fmt: skip
    raise SystemExit(f"unknown model {name!r}; known: {', '.join(ALL_MODELS)}")


# -- running models -----------------------------------------------------------------------------


def run_all(model: Any, x: np.ndarray) -> dict[str, np.ndarray]:
    """Every graph output on every input (batch 1), stacked along a new first axis (a model with
    Q/DQ nodes unoptimised: ``common.inference_session``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.log_severity_level = 3
    session = common.inference_session(model, options)
    name = session.get_inputs()[0].name
    names = [o.name for o in session.get_outputs()]
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for i in range(len(x)):
        for n, value in zip(names, session.run(names, {name: x[i : i + 1]}), strict=True):
            outs[n].append(np.asarray(value)[0])
    return {n: np.stack(v) for n, v in outs.items()}


def output_fidelity(f: np.ndarray, q: np.ndarray) -> dict[str, float]:
    """SQNR (dB) over all images and mean per-image cosine of one output."""
    f64 = f.reshape(len(f), -1).astype(np.float64)
    q64 = q.reshape(len(q), -1).astype(np.float64)
    finite = bool(np.all(np.isfinite(q64)))
    sqnr = common.sqnr_db(f64, q64) if finite else float("nan")
    num = np.sum(f64 * q64, axis=1)
    den = np.linalg.norm(f64, axis=1) * np.linalg.norm(q64, axis=1)
    # A zero vector against a non-zero one has cosine 0 (an all-zero output is not faithful);
    # two zero vectors agree.
    both_zero = (np.linalg.norm(f64, axis=1) == 0) & (np.linalg.norm(q64, axis=1) == 0)
    cos = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(both_zero, 1.0, 0.0))
    return {
        "sqnr_db": round(sqnr, 2),
        "cosine": round(float(np.mean(cos)), 5) if finite else float("nan"),
        "nan_inf": not finite,
    }


# -- person detector ------------------------------------------------------------------------------


def decode_detections(out: np.ndarray, size: int = DET_SIZE) -> np.ndarray:
    """YOLOX raw output (``756 x 6`` at the person detector's 192 x 192; strides 8, 16, 32 on a
    ``size`` x ``size`` input) -> K x 5 (x1, y1, x2, y2, score) after threshold and NMS."""
    grids = []
    for s in DET_STRIDES:
        n = size // s
        gy, gx = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        grids.append(np.stack([gx.ravel(), gy.ravel(), np.full(n * n, s)], axis=1))
    grid = np.concatenate(grids).astype(np.float64)
    o = out.astype(np.float64)
    cx = (o[:, 0] + grid[:, 0]) * grid[:, 2]
    cy = (o[:, 1] + grid[:, 1]) * grid[:, 2]
    w = np.exp(np.minimum(o[:, 2], 50.0)) * grid[:, 2]
    h = np.exp(np.minimum(o[:, 3], 50.0)) * grid[:, 2]
    score = o[:, 4] * o[:, 5]
    keep = score > DET_SCORE
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, score], axis=1)[keep]
    boxes = boxes[np.argsort(-boxes[:, 4], kind="stable")]
    chosen: list[np.ndarray] = []
    for b in boxes:
        if all(_iou(b, c) <= DET_NMS_IOU for c in chosen):
            chosen.append(b)
    return np.array(chosen).reshape(-1, 5)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def detection_match(f_out: np.ndarray, q_out: np.ndarray, size: int = DET_SIZE) -> dict[str, Any]:
    """Share of float detections matched one-to-one by a quantized one at IoU >= 0.5."""
    total = matched = found = images = 0
    for f, q in zip(f_out, q_out, strict=True):
        fd, qd = decode_detections(f, size), decode_detections(q, size)
        total += len(fd)
        found += len(qd)
        images += int(len(fd) > 0)
        free = list(range(len(qd)))
        for box in fd:  # by descending float score (decode sorts)
            best = max(free, key=lambda j: _iou(box, qd[j]), default=None)
            if best is not None and _iou(box, qd[best]) >= DET_MATCH_IOU:
                matched += 1
                free.remove(best)
    return {
        "float_boxes": total,
        "float_images_with_boxes": images,
        "quant_boxes": found,
        "matched": matched,
        "match_rate": round(matched / total, 4) if total else None,
    }


# -- quantization ---------------------------------------------------------------------------------


def make_config(config: str, tweak: Callable[[Any], None] | None = None) -> Any:
    from quark_onnx import get_default_config
    from quark_onnx.config.enums import QuantType

    qc = get_default_config("XINT8")
    if config in ("seed", "seed_real"):
        qc.activation_type = QuantType.QInt8
        qc.optimize_model = False
        qc.extra_options.update(SEED_EXTRA_OPTIONS)
        if config == "seed_real":
            qc.extra_options["UseRandomData"] = False
    elif config != "preset":
        raise SystemExit(f"unknown option set {config!r}; known: {', '.join(CONFIGS)}")
    if tweak is not None:
        tweak(qc)
    return qc


def preset_techniques() -> dict[str, Callable[[Any], None]]:
    """Every technique the XINT8 preset turns on, as ``label -> function that turns it off``."""
    qc = make_config("preset")
    offs: dict[str, Callable[[Any], None]] = {}
    for f in dataclasses.fields(qc):
        if (f.name.startswith("include_") or f.name == "optimize_model") and getattr(
            qc, f.name
        ) is True:
            offs[f.name] = lambda c, n=f.name: setattr(c, n, False)
    options = qc.validate()
    for f in dataclasses.fields(options):
        name = f.name
        if getattr(options, name) is not True or name in FORMAT_OPTIONS:
            continue
        if name.startswith(("Align", "Adjust")) or name.endswith("ToDPUVersion"):
            continue  # NPU rules and the DPU's arithmetic: the target, not a technique
        offs[name] = lambda c, n=name: c.extra_options.__setitem__(n, False)
    return offs


def quantize(entry: Entry, qc: Any, out: Path) -> dict[str, Any]:
    """Quantize ``entry`` with ``qc`` into ``out``; wall time, report facts."""
    import onnx

    from quark_onnx import Config, ModelQuantizer

    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    name = onnx.load(str(entry.float_path), load_external_data=False).graph.input[0].name
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    quantizer.quantize_model(
        str(entry.float_path), str(out), bench_accuracy._Reader(name, entry.calib),
        overwrite=True,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    report = quantizer.report
    return {
        "quant_seconds": round(seconds, 2),
        "report_ready": report.ready if report is not None else None,
        "calibration_samples": (report.calibration or {}).get("samples") if report else None,
        # the tool's own held-out verdict, and the first part it finds not faithful
        "verdict": report.faithful if report is not None else None,
        "verdict_samples": (report.fidelity or {}).get("samples") if report else None,
        "verdict_part": _first_unfaithful_part(report.fidelity if report else {}),
    }


def _first_unfaithful_part(fidelity: dict) -> str | None:
    for output in fidelity.get("outputs", []):
        for part in output.get("parts", []):
            if not part["faithful"]:
                return f"{part['part']} ({part['kind']})"
        if not output.get("faithful", True):
            return output["name"]
    return None


def evaluate(
    entry: Entry, f_out: dict[str, np.ndarray], q_path: Path, float_top1: float | None
) -> dict:
    q_out = run_all(q_path, entry.test)
    row: dict[str, Any] = {"outputs": {}}
    for n, f in f_out.items():
        row["outputs"][n] = output_fidelity(f, q_out[n])
    row["nan_inf"] = any(o["nan_inf"] for o in row["outputs"].values())
    row["min_sqnr_db"] = min(o["sqnr_db"] for o in row["outputs"].values())
    first = next(iter(f_out))
    if entry.task in ("classifier", "ocr"):
        fa = f_out[first].reshape(len(entry.test), -1).argmax(axis=1)
        qa = q_out[first].reshape(len(entry.test), -1).argmax(axis=1)
        row["agreement"] = round(float(np.mean(fa == qa)), 4)
    if entry.labels is not None:
        top1 = float(
            np.mean(q_out[first].reshape(len(entry.test), -1).argmax(axis=1) == entry.labels)
        )
        row["top1"] = round(top1, 4)
        row["drop_points"] = round(100 * (float_top1 - top1), 2)
    if entry.task == "detector":
        row["detection"] = detection_match(f_out[first], q_out[first])
    return row


def _verdict(row: dict) -> str:
    """The tool's held-out verdict: ``yes (16)``, or ``NO (16): <the part>``."""
    if row.get("verdict") is None:
        return "-"
    head = f"{'yes' if row['verdict'] else 'NO'} ({row.get('verdict_samples')})"
    return head if row["verdict"] else f"{head}: {row.get('verdict_part')}"


def check_ready(path: Path) -> bool | None:

    return bool(check(str(path)).ready)


# -- results -------------------------------------------------------------------------------------


def _key(row: dict) -> tuple:
    return (row["model"], row["config"], row.get("technique_off", ""))


def write_results(name: str, rows: list[dict], meta: dict) -> tuple[Path, Path]:
    """This run's rows and the line naming its command and commit (a results file holds the
    latest output only: a subset of models goes to its own --name)."""
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    jpath = common.RESULTS_DIR / f"{name}.json"
    tpath = common.RESULTS_DIR / f"{name}.txt"
    order = {m: i for i, m in enumerate(ALL_MODELS)}
    all_rows = sorted(
        rows,
        key=lambda r: (r.get("technique_off", "") != "", order.get(r["model"], 99), r["config"],
                       r.get("technique_off", "")),
    )  # fmt: skip
    payload = {"runs": [meta], "rows": all_rows}
    _atomic_text(jpath, json.dumps(payload, indent=1, default=float) + "\n")
    _atomic_text(tpath, table(all_rows, [meta]))
    return tpath, jpath


def _atomic_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are ordinary files
    os.replace(tmp, path)


def _fmt(value: Any, spec: str, width: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    if isinstance(value, bool):
        return ("yes" if value else "NO").rjust(width)
    return format(value, spec).rjust(width)


def table(rows: list[dict], runs: list[dict]) -> str:
    lines = [
        f"bench_fidelity.py {' '.join(m.get('argv', []))}: {m.get('date', '')}, "
        f"{m.get('cpu', '')}, {m.get('cores', '')} cores, quark_onnx {m.get('commit', '')}"
        for m in runs
    ]
    lines += [
        "top-1 and drop (points) against the ORIGINAL float model; SQNR = min over graph outputs "
        "(dB); cos = mean per-image cosine of the first output; agree = argmax agreement; "
        "det = share of float detections matched (IoU >= 0.5); check = quark_onnx.check ready; "
        "rerun = identical bytes on a second run; verdict = the tool's own, on the calibration "
        "samples it held out (count), with the first part it finds not faithful",
        "",
        f"{'model':<22} {'config':<9} {'float':>6} {'top-1':>6} {'drop':>6} {'SQNR':>7} "
        f"{'cos':>7} {'agree':>6} {'det':>6} {'NaN':>4} {'quant s':>8} {'check':>6} {'rerun':>6} "
        "verdict",
    ]
    tech_rows = [r for r in rows if r.get("technique_off") not in (None, "", REFERENCE)]
    for r in rows:
        if r.get("technique_off"):
            continue
        if "error" in r:
            lines.append(
                f"{r['model']:<22} {r['config']:<9} ERROR {r['error'].splitlines()[-1][:110]}"
            )
            continue
        first = next(iter(r["outputs"].values()))
        det = (r.get("detection") or {}).get("match_rate")
        lines.append(
            f"{r['model']:<22} {r['config']:<9} {_fmt(r.get('float_top1'), '.4f', 6)} "
            f"{_fmt(r.get('top1'), '.4f', 6)} {_fmt(r.get('drop_points'), '.2f', 6)} "
            f"{_fmt(r['min_sqnr_db'], '.2f', 7)} {_fmt(first['cosine'], '.4f', 7)} "
            f"{_fmt(r.get('agreement'), '.3f', 6)} {_fmt(det, '.3f', 6)} "
            f"{'yes' if r['nan_inf'] else 'no':>4} {_fmt(r['quant_seconds'], '.1f', 8)} "
            f"{_fmt(r.get('check_ready'), '', 6)} {_fmt(r.get('rerun_identical'), '', 6)} "
            f"{_verdict(r)}"
        )
    dets = [r for r in rows if r.get("detection") and not r.get("technique_off")]
    if dets:
        lines += [
            "",
            "person detector: float boxes / images with boxes / quantized boxes / matched",
        ]
        for r in dets:
            d = r["detection"]
            lines.append(
                f"  {r['config']:<9} {d['float_boxes']} / {d['float_images_with_boxes']} / "
                f"{d['quant_boxes']} / {d['matched']}"
            )
    if tech_rows:
        lines += [
            "",
            "techniques (--techniques): min output SQNR (dB) with the preset and with one "
            "technique off; delta = off - preset (> 0: the technique lowers SQNR)",
            f"{'model':<22} {'technique off':<36} {'preset':>8} {'off':>8} {'delta':>7} "
            f"{'top-1 off':>9} {'det off':>7}",
        ]
        base = {r["model"]: r for r in rows if r.get("technique_off") == REFERENCE}
        for r in tech_rows:
            ref = base.get(r["model"])
            if "error" in r:
                last = r["error"].splitlines()[-1][:80]
                lines.append(f"{r['model']:<22} {r['technique_off']:<36} ERROR {last}")
                continue
            ref_sqnr = ref["min_sqnr_db"] if ref and "error" not in ref else None
            delta = r["min_sqnr_db"] - ref_sqnr if ref_sqnr is not None else None
            det = (r.get("detection") or {}).get("match_rate")
            flag = "  <- lowers SQNR" if delta is not None and delta > 0.1 else ""
            lines.append(
                f"{r['model']:<22} {r['technique_off']:<36} {_fmt(ref_sqnr, '.2f', 8)} "
                f"{_fmt(r['min_sqnr_db'], '.2f', 8)} {_fmt(delta, '+.2f', 7)} "
                f"{_fmt(r.get('top1'), '.4f', 9)} {_fmt(det, '.3f', 7)}{flag}"
            )
    return "\n".join(lines) + "\n"


# -- driver -------------------------------------------------------------------------------------


def _git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(common.REPO_DIR), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(
    entry: Entry,
    config: str,
    f_out: dict[str, np.ndarray],
    float_top1: float | None,
    *,
    rerun: bool,
    technique: str = "",
    tweak: Callable[[Any], None] | None = None,
) -> dict:
    row: dict[str, Any] = {"model": entry.name, "base": entry.base, "config": config}
    if technique:
        row["technique_off"] = technique
    if float_top1 is not None:
        row["float_top1"] = round(float_top1, 4)
    suffix = {"": "", REFERENCE: ".reference"}.get(technique, f".no-{technique}")
    tag = f"{entry.name}.{config}{suffix}"
    out = WORK / "out" / f"{tag}.onnx"
    try:
        row.update(quantize(entry, make_config(config, tweak), out))
        row.update(evaluate(entry, f_out, out, float_top1))
        if technique in ("", REFERENCE):
            row["check_ready"] = check_ready(out)
        if rerun:
            again = WORK / "out" / f"{tag}.rerun.onnx"
            quantize(entry, make_config(config, tweak), again)
            row["rerun_identical"] = out.read_bytes() == again.read_bytes()
    except Exception as exc:  # recorded in the table; the benchmark goes on
        row["error"] = common.error_text(exc)
    return row


def _gptq(target: str) -> Callable[[Any], None] | None:
    """``--gptq-target``: second-order rounding in bias correction's walk with this target."""
    if not target:
        return None

    def on(qc: Any) -> None:
        qc.include_fast_ft = True
        qc.extra_options["FastFinetune"] = {"OptimAlgorithm": "gptq", "Target": target}

    return on


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="all", help=f"comma separated from {','.join(ALL_MODELS)}"
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rerun", action="store_true", help="quantize twice, compare the bytes")
    parser.add_argument(
        "--techniques",
        action="store_true",
        help="preset with each of its techniques off (shared models by default)",
    )
    parser.add_argument(
        "--only-techniques",
        default="",
        help="with --techniques: comma separated subset of the discovered list",
    )
    parser.add_argument(
        "--gptq-target",
        default="",
        help="also second-order rounding (include_fast_ft, OptimAlgorithm gptq) with this "
        "FastFinetune Target (float, weights, debiased) in every option set",
    )
    parser.add_argument("--name", default="fidelity", help="results/<name>.{txt,json}")
    args = parser.parse_args(argv)  # fmt: skip
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    default_models = BASE_MODELS if args.techniques else ALL_MODELS
    models = list(default_models) if args.models == "all" else args.models.split(",")
    configs = args.configs.split(",")
    offs = preset_techniques() if args.techniques else {}
    if args.only_techniques:
        wanted = args.only_techniques.split(",")
        unknown = sorted(set(wanted) - set(offs))
        if unknown:
            raise SystemExit(f"unknown technique(s) {unknown}; the preset enables {sorted(offs)}")
        offs = {k: offs[k] for k in wanted}
    meta = {**common.machine_info(), "commit": _git_commit(), "argv": sys.argv[1:]}
    if args.gptq_target:
        meta["gptq_target"] = args.gptq_target
    if offs:
        meta["techniques"] = sorted(offs)
    rows: list[dict] = []
    floats: dict[str, tuple[dict[str, np.ndarray], float | None]] = {}
    for name in models:
        entry = load_entry(name)
        if entry.base not in floats:
            # Variants are compared with the ORIGINAL float model (outputs and top-1).
            original = Path(bench_accuracy.MODELS.get(entry.base, entry.float_path))
            f_orig = run_all(original, entry.test)
            top1 = None
            if entry.labels is not None:
                first = next(iter(f_orig.values())).reshape(len(entry.test), -1)
                top1 = float(np.mean(first.argmax(axis=1) == entry.labels))
            floats[entry.base] = (f_orig, top1)
        f_out, float_top1 = floats[entry.base]
        print(f"{name}: original float top-1 {float_top1}", flush=True)
        variant_float: dict[str, Any] = {}
        if entry.name != entry.base:  # a stress variant: show that its float model is the same
            v_out = run_all(entry.float_path, entry.test)
            first = next(iter(v_out.values())).reshape(len(entry.test), -1)
            variant_float["variant_float_top1"] = round(
                float(np.mean(first.argmax(axis=1) == entry.labels)), 4
            )
            variant_float["variant_float_max_rel_diff"] = float(
                max(np.max(np.abs(v_out[n] - f)) / np.max(np.abs(f)) for n, f in f_out.items())
            )
        jobs: list[tuple[str, str, Callable[[Any], None] | None]] = []
        if args.techniques:
            jobs.append(("preset", REFERENCE, None))
            jobs += [("preset", t, fn) for t, fn in offs.items()]
        else:
            jobs += [(c, "", _gptq(args.gptq_target)) for c in configs]
        for config, technique, tweak in jobs:
            rerun = args.rerun and not technique
            row = measure(
                entry, config, f_out, float_top1, rerun=rerun, technique=technique, tweak=tweak
            )
            row.update(variant_float)
            rows.append(row)
            if technique:
                err = row.get("error", "")[-200:]
                label = "preset" if technique == REFERENCE else f"no-{technique}"
                print(f"  {label}: SQNR {row.get('min_sqnr_db')} {err}", flush=True)
            else:
                print(table([row], []).splitlines()[-1], flush=True)
    tpath, jpath = write_results(args.name, rows, meta)
    print()
    print(tpath.read_text())
    print(f"written: {tpath} {jpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
