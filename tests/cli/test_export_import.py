"""``quark-onnx export`` / ``quark-onnx import`` (and ``quantize --preset``) on tiny models."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli, tiny_cnn
from conftest import run_ort, shared_path

from quark_onnx.cli import build_parser, main
from quark_onnx.config.presets import preset_names


def run_main(*args: object, cwd: Path, capsys) -> subprocess.CompletedProcess:
    """The CLI in this process (fast): same exit code and output as the console script."""
    import os

    here = Path.cwd()
    os.chdir(cwd)
    try:
        code = main([str(a) for a in args])
    finally:
        os.chdir(here)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The tiny model quantized by `quark-onnx quantize` (XINT8)."""
    root = tmp_path_factory.mktemp("export")
    onnx.save(tiny_cnn(5, relu2=False), root / "tiny.onnx")
    x = np.random.default_rng(1).uniform(0, 1, (8, 3, 8, 8)).astype(np.float32)
    np.savez(root / "calib.npz", x=x)
    done = run_cli(
        "quantize", "tiny.onnx", "-o", "out", "--calib", "calib.npz", "--compare-samples", "0",
        cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return root


def test_export_recipe_then_import_rebuilds_byte_identically(work, tmp_path, capsys):
    done = run_cli(
        "export", work / "out/tiny.onnx", "--format", "recipe", "--float-model",
        work / "tiny.onnx", "--report", work / "out/tiny.report.json", "-o", tmp_path / "rec",
        cwd=work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "byte for byte" in done.stdout
    assert (tmp_path / "rec" / "recipe.json").is_file()
    done = run_main(
        "import", tmp_path / "rec", "--float-model", work / "tiny.onnx",
        "-o", tmp_path / "rebuilt.onnx", cwd=work, capsys=capsys,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rebuilt.onnx").read_bytes() == (work / "out/tiny.onnx").read_bytes()
    # the same recipe from the preset name
    done = run_main(
        "export", work / "out/tiny.onnx", "--format", "recipe", "--float-model",
        work / "tiny.onnx", "--preset", "XINT8", "-o", tmp_path / "rec2", cwd=work, capsys=capsys,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_export_recipe_refuses_another_float_model(work, tmp_path, capsys):
    other = tiny_cnn(5, relu2=False)
    other.graph.node[1].op_type = "Sigmoid"  # same tensors, another function
    onnx.save(other, tmp_path / "other.onnx")
    done = run_main(
        "export", work / "out/tiny.onnx", "--format", "recipe", "--float-model",
        tmp_path / "other.onnx", "-o", tmp_path / "rec_bad", cwd=work, capsys=capsys,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "would not reproduce" in done.stderr
    assert not (tmp_path / "rec_bad" / "recipe.json").exists()


def test_import_qdq_model_writes_a_recipe_that_rebuilds_it(work, tmp_path, capsys):
    done = run_main(
        "import", work / "out/tiny.onnx", "-o", tmp_path / "imp", cwd=work, capsys=capsys
    )
    assert done.returncode == 0, done.stderr
    for name in ("recipe.json", "params.safetensors", "float_model.onnx"):
        assert (tmp_path / "imp" / name).is_file()
    done = run_main(
        "import", tmp_path / "imp", "-o", tmp_path / "again.onnx", cwd=work, capsys=capsys
    )
    assert done.returncode == 0, done.stderr
    x = np.random.default_rng(2).uniform(0, 1, (1, 3, 8, 8)).astype(np.float32)
    (expected,) = run_ort(onnx.load(work / "out/tiny.onnx"), {"x": x})
    (got,) = run_ort(onnx.load(tmp_path / "again.onnx"), {"x": x})
    np.testing.assert_array_equal(got, expected)


def test_export_onnx_and_gguf(work, tmp_path, capsys):
    done = run_main(
        "export", work / "out/tiny.onnx", "--format", "onnx", "-o", tmp_path / "copy.onnx",
        cwd=work, capsys=capsys,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert onnx.load(tmp_path / "copy.onnx") == onnx.load(work / "out/tiny.onnx")
    pytest.importorskip("gguf")
    done = run_main(
        "export",
        work / "out/tiny.onnx",
        "--format",
        "gguf",
        "-o",
        tmp_path / "m.gguf",
        cwd=work,
        capsys=capsys,
    )
    # an XINT8 model holds no block-quantized weight and no float tensor GGUF can take: refused
    assert done.returncode == 1
    assert "no tensor can be written to GGUF" in done.stderr
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["export", "out/tiny.onnx", "--format", "recipe", "-o", "r"], 2, "--float-model"),
        (["export", "missing.onnx", "--format", "onnx", "-o", "c.onnx"], 2, "no such file"),
        (["export", "out/tiny.onnx", "--format", "onnx", "-o", "out/tiny.onnx"], 1, "input"),
        (
            ["export", "out/tiny.onnx", "--format", "gguf", "--preset", "XINT8", "-o", "m.gguf"],
            2,
            "apply to --format recipe",
        ),
        (["import", "nowhere", "-o", "r"], 2, "no such QDQ model file or recipe folder"),
        (["import", "out", "-o", "r.onnx"], 2, "not a recipe folder"),
        (["import", "out/tiny.onnx", "--float-model", "tiny.onnx", "-o", "r"], 2, "applies to"),
    ],
)
def test_usage_errors_are_one_line(work, args, code, message, capsys):
    done = run_main(*args, cwd=work, capsys=capsys)
    assert done.returncode == code, done.stderr
    assert done.stderr.startswith("error: ") and message in done.stderr
    assert "Traceback" not in done.stderr


def test_outputs_are_never_replaced_without_overwrite(work, tmp_path, capsys):
    target = tmp_path / "exists.onnx"
    target.write_bytes(b"keep")
    done = run_main(
        "export", work / "out/tiny.onnx", "--format", "onnx", "-o", target, cwd=work, capsys=capsys
    )
    assert done.returncode == 1 and "--overwrite" in done.stderr
    assert target.read_bytes() == b"keep"


def test_quantize_accepts_every_preset_in_configs():
    parser = build_parser()
    for name in preset_names():
        args = parser.parse_args(["quantize", "m.onnx", "-o", "out", "--preset", name])
        assert args.config == name
    help_text = parser._subparsers._group_actions[0].choices["quantize"].format_help()
    for name in preset_names():
        assert name in help_text


@pytest.mark.real_model
@pytest.mark.slow
def test_digits_export_import_round_trip(tmp_path):
    model = shared_path("models", "digits_cnn.onnx")
    calib = np.load(shared_path("models", "digits_calib.npz"))["x"][:16]
    np.savez(tmp_path / "calib.npz", x=calib)
    done = run_cli(
        "quantize", model, "-o", "out", "--calib", "calib.npz", "--compare-samples", "0",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = run_cli(
        "export", "out/digits_cnn.onnx", "--format", "recipe", "--float-model", model,
        "--report", "out/digits_cnn.report.json", "-o", "rec", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = run_cli("import", "rec", "--float-model", model, "-o", "re.onnx", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "re.onnx").read_bytes() == (tmp_path / "out/digits_cnn.onnx").read_bytes()
