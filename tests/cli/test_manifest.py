"""quark-onnx quantize --manifest: per model its calibration data, pre-processing, preset and
options; each model comes out as from its own single run."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from cli_helpers import png_folder, run_cli, tiny_cnn

from quark_onnx.cli import QuantizeSettings
from quark_onnx.cli.manifest import read_manifest
from quark_onnx.errors import ConfigError

#: Three pre-processings of the same images: each model is calibrated on different inputs.
SPECS = [
    "resize=stretch,size=8,scale=1/255",
    "resize=stretch,size=8,mean=127,std=128,order=BGR",
    "resize=stretch,size=8,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225",
]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    for i in range(3):
        onnx.save(tiny_cnn(i), tmp_path / f"m{i}.onnx")
    png_folder(tmp_path / "images")
    return tmp_path


def test_a_manifest_batch_gives_the_outputs_of_three_single_runs(work):
    manifest = work / "models.toml"
    manifest.write_text(
        'calib = "images"\n'
        "set = { CalibDataSize = 10 }\n"
        + "".join(
            f'\n[[model]]\nfile = "m{i}.onnx"\npreprocess = "{spec}"\n'
            for i, spec in enumerate(SPECS)
        )
        + "set = { ActivationSymmetric = true }\n"  # the last model's own option
    )
    batch = run_cli("quantize", "--manifest", manifest, "-o", work / "batch", cwd=work)
    assert batch.returncode == 0, batch.stderr
    outputs = []
    for i, spec in enumerate(SPECS):
        extra = ["--set", "ActivationSymmetric=true"] if i == 2 else []
        single = run_cli(
            "quantize", f"m{i}.onnx", "-o", work / f"single{i}", "--calib", "images",
            "--preprocess", spec, "--set", "CalibDataSize=10", *extra, cwd=work,
        )  # fmt: skip
        assert single.returncode == 0, single.stderr
        expected = (work / f"single{i}" / f"m{i}.onnx").read_bytes()
        outputs.append(expected)
        assert (work / "batch" / f"m{i}.onnx").read_bytes() == expected, f"m{i}"
    assert len(set(outputs)) == 3  # three different calibrations, three different models
    # the summary shows each model's own settings
    lines = batch.stdout.splitlines()
    settings = lines[lines.index("settings:") + 1 :]
    images = str((work / "images").resolve())
    for i, spec in enumerate(SPECS):
        own = " --set ActivationSymmetric=true" if i == 2 else ""
        assert settings[i] == (
            f"  m{i}: --config XINT8 --calib {images} --preprocess '{spec}' "
            f"--set CalibDataSize=10{own}"
        )


def test_manifest_errors_name_the_file_the_model_and_the_key(work):
    base = QuantizeSettings()
    bad = work / "bad.toml"
    bad.write_text('[[model]]\nfile = "m0.onnx"\npreprocesss = "resize=8"\n')
    with pytest.raises(ConfigError, match=r"bad.toml, model 1: unknown key 'preprocesss'; did "):
        read_manifest(bad, base)
    bad.write_text('calib_limit = "8"\n[[model]]\nfile = "m0.onnx"\n')
    with pytest.raises(ConfigError, match=r"\(defaults\): calib_limit = '8': expected a int"):
        read_manifest(bad, base)
    bad.write_text("calib = 'images'\n")
    with pytest.raises(ConfigError, match=r"no \[\[model\]\] table"):
        read_manifest(bad, base)
    # the command line's per-model flags are the manifest's business
    bad.write_text('[[model]]\nfile = "m0.onnx"\nrandom_calib = 4\n')
    both = run_cli("quantize", "--manifest", bad, "-o", work / "o", "--calib", "images", cwd=work)
    assert both.returncode == 2
    assert both.stderr.startswith("error: --calib with --manifest: set it in the manifest")
    # a model's own source replaces the default one
    bad.write_text('calib = "images"\n[[model]]\nfile = "m0.onnx"\nrandom_calib = 4\n')
    (entry,) = read_manifest(bad, base)
    assert (entry.settings.calib, entry.settings.random_samples) == (None, 4)
    assert entry.model == work / "m0.onnx" and entry.name == "m0"
