"""The documentation's worked pre-processing specs run as written, one generated model each.

Every command of the bash block in ``docs/preprocessing.md`` (linked from the README) is run
with its model, image folder and output folder replaced by generated ones: a small
convolutional network with the input shape the comment above the command gives (``?`` for a
dynamic dimension) and a head that fits the family (a score vector for classifiers, a dense map
for segmenters, rows of box values otherwise), and five PNG images of different sizes and aspect
ratios.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import onnx
import pytest
from cli_helpers import run_cli
from test_cli_families import SIZES, conv_net, image_folder

ROOT = Path(__file__).resolve().parents[2]
PREPROCESSING = (ROOT / "docs" / "preprocessing.md").read_text(encoding="utf-8")


def readme_examples() -> list[tuple[str, list, str]]:
    """(model file name, input dims, command) for each example of docs/preprocessing.md."""
    section = re.search(r"```bash\n(.*?)\n```", PREPROCESSING, re.S)
    assert section, "docs/preprocessing.md has no bash block"
    lines = section.group(1).splitlines()
    examples = []
    for comment, command in zip(lines[0::2], lines[1::2], strict=True):
        shape = re.search(r"\(input ([0-9?x]+)\)", comment)
        assert comment.startswith("# ") and shape, f"no '(input NxCxHxW)' in {comment!r}"
        dims = [int(d) if d.isdigit() else f"d{i}" for i, d in enumerate(shape.group(1).split("x"))]
        args = shlex.split(command)
        assert args[:2] == ["quark-onnx", "quantize"], command
        examples.append((args[2], dims, command))
    return examples


EXAMPLES = readme_examples()


def test_every_family_has_an_example():
    names = {name for name, _, _ in EXAMPLES}
    assert names == {
        "classifier.onnx", "yolox.onnx", "face_detector.onnx", "segmenter.onnx", "ocr_cls.onnx",
        "ocr_rec.onnx", "ocr_det.onnx",
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dims", "command"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_readme_example_runs(tmp_path, name, dims, command):
    head = {"segmenter.onnx": "dense", "classifier.onnx": "scores", "ocr_cls.onnx": "scores"}
    onnx.save(conv_net(dims, head.get(name, "boxes")), tmp_path / name)
    image_folder(tmp_path / "images", SIZES)
    args = shlex.split(command)[1:]  # the console script is run as python -m quark_onnx
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / name.replace(".onnx", ".report.json")).read_text())
    # a quarter of the images is held out for the verdict, which says how many judged it
    held = len(SIZES) // 4
    assert report["calibration"]["samples"] == len(SIZES) - held
    assert report["fidelity"]["samples"] == held
    (value,) = onnx.load(tmp_path / "out" / name).graph.input
    shape = value.type.tensor_type.shape.dim
    written = [d.dim_value if d.HasField("dim_value") else None for d in shape]
    size_follows_image = name == "ocr_det.onnx"
    # static inputs stay, a fixed-size spec fixes a dynamic input (XINT8 default: the
    # recognizer's width too); a spec whose size follows the image leaves the spatial dims
    # dynamic and the model not ready
    assert (None in written) == size_follows_image
    assert report["check"]["ready"] is (not size_follows_image)
    if name == "ocr_rec.onnx":
        assert written == [1, 3, 32, 320]
    elif not size_follows_image:
        assert written == [1, *dims[1:]]
