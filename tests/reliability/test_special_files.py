"""Every path the tool reads goes through one check: a FIFO, a device (``/dev/zero`` through a
symbolic link) or a folder is named as such ("is a FIFO, not a regular file"), never reported
as missing and never read; a file above its size cap is refused from its size.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fuzz_models import conv_chain, quantizer
from test_nothing_lost import one_error_line, run_cli

from quark_onnx.calibration.readers import NpzDataReader
from quark_onnx.errors import CalibrationError, ModelLoadError, QuarkOnnxError
from quark_onnx.formats.recipe import read_recipe
from quark_onnx.formats.safetensors_io import load_file
from quark_onnx.npu.readiness import check

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")


@pytest.fixture
def specials(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, the words the error must use)."""
    fifo = tmp_path / "fifo.onnx"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.onnx"
    zero.symlink_to("/dev/zero")
    folder = tmp_path / "folder.onnx"
    folder.mkdir()
    return {
        "fifo": (fifo, "is a FIFO, not a regular file"),
        "device": (zero, "is a device, not a regular file"),
        "folder": (folder, "is a folder, not a regular file"),
    }


def _assert_named(exc: BaseException, path: Path, words: str) -> None:
    text = str(exc)
    assert str(path) in text and words in text, text
    assert "no such" not in text and "not found" not in text, text


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_api_readers_name_the_special_file(specials, kind, tmp_path):
    path, words = specials[kind]
    readers = [
        (ModelLoadError, lambda: quantizer().quantize_model(path, tmp_path / "q.onnx")),
        (ModelLoadError, lambda: check(path)),
        (CalibrationError, lambda: NpzDataReader(path, input_name="x")),
        (QuarkOnnxError, lambda: load_file(path)),
    ]
    for error, read in readers:
        with pytest.raises(error) as info:
            read()
        _assert_named(info.value, path, words)
    assert not (tmp_path / "q.onnx").exists()


def test_a_recipe_file_that_is_a_fifo(tmp_path):
    folder = tmp_path / "rec"
    folder.mkdir()
    os.mkfifo(folder / "recipe.json")
    with pytest.raises(QuarkOnnxError) as info:
        read_recipe(folder)
    assert "is a FIFO, not a regular file" in str(info.value)


def test_a_sparse_model_above_the_protobuf_limit_is_refused_from_its_size(tmp_path):
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:
        f.truncate(3 << 30)  # 3 GiB declared, nothing written
    with pytest.raises(ModelLoadError, match="above the .*-byte limit for a ONNX model"):
        check(big)


def test_check_of_bytes_or_none_is_a_model_load_error():
    with pytest.raises(ModelLoadError, match="got bytes .*onnx.load_from_string"):
        check(conv_chain().SerializeToString())
    with pytest.raises(ModelLoadError, match="got NoneType"):
        check(None)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["quantize", "fifo.onnx", "-o", "out", "--random-calib", "1"], "is a FIFO"),
        (["quantize", "m.onnx", "-o", "out", "--calib", "fifo.npz"], "--calib fifo.npz: is a FIFO"),
        (["quantize", "m.onnx", "-o", "out", "--load-calibration", "fifo.json"], "is a FIFO"),
        (["compare", "zero.onnx", "m.onnx", "--random", "1"], "zero.onnx: is a device"),
        (["compare", "m.onnx", "m.onnx", "--data", "fifo.npz"], "--data fifo.npz: is a FIFO"),
        (["export", "fifo.onnx", "--format", "onnx", "-o", "e.onnx"], "MODEL fifo.onnx: is a"),
        (["import", "fifo.onnx", "-o", "rec"], "fifo.onnx: is a FIFO"),
        (["check", "zero.onnx"], "zero.onnx: is a device"),
    ],
    ids=["model", "calib", "load-calibration", "compare-random", "compare-data", "export",
         "import", "check"],
)  # fmt: skip
def test_cli_names_the_special_file(tmp_path, argv, words):
    (tmp_path / "m.onnx").write_bytes(conv_chain().SerializeToString())
    for name in ("fifo.onnx", "fifo.npz", "fifo.json"):
        os.mkfifo(tmp_path / name)
    (tmp_path / "zero.onnx").symlink_to("/dev/zero")
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode != 0
    line = one_error_line(proc)
    assert words in line and "no such" not in line, line
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".partial")]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
