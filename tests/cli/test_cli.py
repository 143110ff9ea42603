"""The ``quark-onnx`` console script, run as a subprocess on tiny models (fast)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli, tiny_cnn
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.cli import apply_assignments, build_parser, parse_assignments, parse_value
from quark_onnx.config.quantization import get_default_config
from quark_onnx.errors import ConfigError

F = TensorProto.FLOAT


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Two tiny models, their calibration data and a corrupt model file."""
    root = tmp_path_factory.mktemp("cli")
    models = root / "models"
    models.mkdir()
    for i in range(2):
        onnx.save(tiny_cnn(i), models / f"tiny{i}.onnx")
    x = np.random.default_rng(7).uniform(0, 1, (16, 1, 3, 8, 8)).astype(np.float32)
    np.savez(root / "calib.npz", x=x.reshape(16, 1, 3, 8, 8)[:, 0])
    (root / "corrupt.onnx").write_bytes(b"\x08\x07 this is not a protobuf " * 20)
    return root


# ------------------------------------------------------------------------------------------------
# --set parsing (in process)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("true", True),
        ("False", False),
        ("3", 3),
        ("0.5", 0.5),
        ("[1, 2]", [1, 2]),
        ('{"x": [0, 1]}', {"x": [0, 1]}),
        ("null", None),
        ("NonOverflow", "NonOverflow"),
        ("input:[1,3,8,8]", "input:[1,3,8,8]"),
    ],
)
def test_parse_value_json_then_python_literals_then_string(text, value):
    assert parse_value(text) == value
    assert type(parse_value(text)) is type(value)


def test_set_assigns_config_fields_and_extra_options():
    qc = get_default_config("XINT8")
    apply_assignments(
        qc,
        parse_assignments(
            ["include_cle=true", "calibrate_method=NonOverflow", "ActivationSymmetric=false"]
        ),
    )
    assert qc.include_cle is True
    assert str(qc.calibrate_method).endswith("NonOverflow")
    assert qc.extra_options["ActivationSymmetric"] is False
    assert "include_cle" not in qc.extra_options


@pytest.mark.parametrize(
    ("item", "suggestion"),
    [("include_cl=true", "include_cle"), ("ActivationSymetric=true", "ActivationSymmetric")],
)
def test_set_unknown_key_names_the_closest_of_either_kind(item, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        apply_assignments(get_default_config("XINT8"), parse_assignments([item]))


def test_set_wrong_type_and_malformed_item():
    with pytest.raises(ConfigError, match="expects bool"):
        apply_assignments(get_default_config("XINT8"), parse_assignments(["include_cle=3"]))
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_assignments(["include_cle"])


# ------------------------------------------------------------------------------------------------
# Help and usage errors (subprocess)
# ------------------------------------------------------------------------------------------------


def _subparsers():
    parser = build_parser()
    (action,) = [a for a in parser._actions if a.dest == "command"]
    return action.choices


HELP_COMMANDS = ["quantize", "check", "compare", "presets", "options", "export", "import"]


def test_help_test_covers_every_command():
    assert set(_subparsers()) == set(HELP_COMMANDS)


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_help_explains_every_flag(command, tmp_path):
    sub = _subparsers()[command]
    result = run_cli(command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for action in sub._actions:
        assert action.help and len(action.help) > 10, action.dest
        for flag in action.option_strings:
            assert flag in result.stdout, flag


def test_unknown_preset_is_one_error_line(tmp_path, work):
    result = run_cli(
        "quantize", work / "models", "-o", tmp_path / "o", "--config", "XINT9", "--random-calib",
        "2", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: unknown preset 'XINT9'; did you mean 'XINT8'?")
    assert not (tmp_path / "o").exists()  # nothing is written before the config is valid


def test_unknown_option_is_one_error_line_and_debug_shows_traceback(tmp_path, work):
    args = ["quantize", work / "models", "-o", tmp_path / "o", "--random-calib", "2"]
    result = run_cli(*args, "--set", "RemoveQDQConvRelus=true", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unknown setting 'RemoveQDQConvRelus' in --set; did you mean "
        "'RemoveQDQConvRelu'? (a QuantizationConfig field or an extra option: see "
        "`quark-onnx options`)"
    ]
    debug = run_cli(*args, "--set", "RemoveQDQConvRelus=true", "--debug", cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_quantize_without_calibration_data_is_a_usage_error(tmp_path, work):
    result = run_cli("quantize", work / "models", "-o", tmp_path / "o", cwd=tmp_path)
    assert result.returncode == 2
    assert "no calibration data" in result.stderr


def test_bad_preprocess_spec_names_the_closest_key(tmp_path, work):
    result = run_cli(
        "quantize", work / "models", "-o", tmp_path / "o", "--calib", tmp_path,
        "--preprocess", "resize=256,crops=224", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "did you mean 'crop'" in result.stderr


def test_presets_and_options_list_settings(tmp_path):
    result = run_cli("presets", cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout.startswith("XINT8: ")
    assert "enable_npu_cnn = True" in result.stdout
    data = json.loads(run_cli("presets", "--all", "--json", cwd=tmp_path).stdout)
    assert data["XINT8"]["settings"]["extra_options"]["AlignConcat"] is True
    options = run_cli("options", "Int32Bias", cwd=tmp_path)
    assert options.stdout.startswith("Int32Bias (bool, default False)")
    wrong = run_cli("options", "Int32Bais", cwd=tmp_path)
    assert wrong.returncode == 2 and "did you mean 'Int32Bias'" in wrong.stderr


# ------------------------------------------------------------------------------------------------
# quantize / check / compare on tiny models
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_batch_with_a_corrupt_model(tmp_path, work):
    out = tmp_path / "out"
    result = run_cli(
        "quantize", work / "models", work / "corrupt.onnx", "-o", out, "--calib",
        work / "calib.npz", "--compare-samples", "4", "--compare-layers", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert errors[0].startswith(f"error: {work / 'corrupt.onnx'}: not a valid ONNX model")
    assert "Traceback" not in result.stderr
    for name in ("tiny0", "tiny1"):
        report = json.loads((out / f"{name}.report.json").read_text())
        assert report["output"] == str(out / f"{name}.onnx")
        assert report["calibration"]["samples"] == 12  # 4 of the 16 held out for the verdict
        assert report["positions"] and report["check"]["ready"] is True
        assert (out / f"{name}.report.txt").read_text().startswith(f"model: {work / 'models'}")
        comparison = json.loads((out / f"{name}.compare.json").read_text())
        assert comparison["samples"] == 4
        assert {t["name"] for t in comparison["layers"]} >= {"x", "r1", "r2"}
    assert not (out / "corrupt.onnx").exists()
    table = result.stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:5]}
    assert rows["tiny0"][1] == "ok" and rows["tiny1"][1] == "ok"
    assert rows["corrupt"][1:] == ["failed", "0.0", "-", "-", "-", "-", "-"]
    assert "2 of 3 models quantized, 1 failed" in result.stdout

    # check: the quantized model is ready (exit 0); the float one is not and says why (exit 1)
    ready = run_cli("check", out / "tiny0.onnx", cwd=tmp_path)
    assert ready.returncode == 0, ready.stdout
    assert ready.stdout.strip() == f"{out / 'tiny0.onnx'}: Vitis AI ready"
    float_check = run_cli("check", work / "models" / "tiny0.onnx", cwd=tmp_path)
    assert float_check.returncode == 1
    assert "NOT Vitis AI ready" in float_check.stdout
    assert "error not_quantized:" in float_check.stdout

    # an existing output is not replaced without --overwrite
    again = run_cli(
        "quantize", work / "models" / "tiny0.onnx", "-o", out, "--random-calib", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 1
    assert "exists; pass --overwrite" in again.stderr


@pytest.mark.slow
def test_jobs_do_not_change_the_outputs(tmp_path, work):
    outs = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs{jobs}"
        result = run_cli(
            "quantize", work / "models", "-o", out, "--random-calib", "4", "--jobs", jobs,
            "--compare-samples", "0", "--save-calibration", cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        outs[jobs] = out
    for name in ("tiny0", "tiny1"):
        for suffix in (".onnx", ".calibration.json"):
            a = (outs[1] / f"{name}{suffix}").read_bytes()
            assert a == (outs[2] / f"{name}{suffix}").read_bytes(), name + suffix
        r1 = json.loads((outs[1] / f"{name}.report.json").read_text())
        r2 = json.loads((outs[2] / f"{name}.report.json").read_text())
        assert r1["positions"] == r2["positions"]
    # the two models differ (the comparison above is not trivially true)
    assert (outs[1] / "tiny0.onnx").read_bytes() != (outs[1] / "tiny1.onnx").read_bytes()
    assert not list(outs[2].glob("*.partial")) and not list(outs[2].glob(".*"))


def test_exclude_and_set_reach_the_quantizer(tmp_path, work):
    out = tmp_path / "out"
    result = run_cli(
        "quantize", work / "models" / "tiny0.onnx", "-o", out, "--random-calib", "2",
        "--set", "Int32Bias=true", "--set", "calibrate_method=NonOverflow",
        "--exclude", "conv2", "no_such_node", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "tiny0.report.json").read_text())
    assert report["settings"]["extra_options"]["Int32Bias"] is True
    assert report["settings"]["calibrate_method"].endswith("NonOverflow")
    assert report["settings"]["nodes_to_exclude"] == ["conv2", "no_such_node"]
    assert {"node": "conv2", "op_type": "Conv", "reason": "excluded by nodes_to_exclude"} in (
        report["float_nodes"]
    )
    assert "--exclude 'no_such_node' matches no node" in result.stderr
    model = onnx.load(out / "tiny0.onnx")
    biases = [t for t in model.graph.initializer if t.name.startswith("b1")]
    assert any(t.data_type == TensorProto.INT32 for t in biases)


def test_saved_calibration_is_reused(tmp_path, work):
    first = tmp_path / "first"
    model = work / "models" / "tiny0.onnx"
    calib = work / "calib.npz"
    # bias correction needs the samples themselves, which a saved calibration does not hold
    no_bc = ("--set", "include_bias_correction=false")
    saved = run_cli("quantize", model, "-o", first, "--calib", calib, "--save-calibration",
                    *no_bc, cwd=tmp_path)  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    second = tmp_path / "second"
    result = run_cli(
        "quantize", model, "-o", second, "--load-calibration", first / "tiny0.calibration.json",
        *no_bc, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (first / "tiny0.onnx").read_bytes() == (second / "tiny0.onnx").read_bytes()
    assert not (second / "tiny0.compare.json").exists()  # no data to compare on


def test_compare_command(tmp_path, work):
    out = tmp_path / "out"
    model = work / "models" / "tiny1.onnx"
    done = run_cli("quantize", model, "-o", out, "--calib", work / "calib.npz", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = run_cli(
        "compare", model, out / "tiny1.onnx", "--data", work / "calib.npz", "--limit", "5",
        "--json", tmp_path / "c.json", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("compared on 5 sample(s)\noutput y: SQNR ")
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["samples"] == 5 and data["outputs"][0]["name"] == "y"
    sqnrs = [t["sqnr_db"] for t in data["layers"]]
    assert sqnrs == sorted(sqnrs)
    missing = run_cli("compare", model, out / "tiny1.onnx", cwd=tmp_path)
    assert missing.returncode == 2 and "compare needs data" in missing.stderr


def test_npz_for_a_two_input_model_needs_one_array_per_input(tmp_path):
    from quark_onnx.cli import npz_reader
    from quark_onnx.errors import CalibrationError

    model = make_model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [helper.make_tensor_value_info(n, F, ["N", 2]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", F, ["N", 2])],
    )
    onnx.save(model, tmp_path / "two.onnx")
    a, b = np.arange(6, dtype=np.float32).reshape(3, 2), np.ones((3, 2), np.float32)
    np.savez(tmp_path / "ok.npz", a=a, b=b, extra=a)
    reader = npz_reader(tmp_path / "ok.npz", tmp_path / "two.onnx", limit=2)
    feeds = list(iter(reader.get_next, None))
    assert len(feeds) == 2
    np.testing.assert_array_equal(feeds[1]["a"], a[1:2])
    np.testing.assert_array_equal(feeds[1]["b"], b[1:2])
    np.savez(tmp_path / "bad.npz", a=a, x=b)
    with pytest.raises(CalibrationError, match=r"missing \['b'\]"):
        npz_reader(tmp_path / "bad.npz", tmp_path / "two.onnx")


def test_check_a_folder_and_json(tmp_path, work):
    result = run_cli("check", work / "models", "--json", cwd=tmp_path)
    assert result.returncode == 1  # float models are not ready
    data = json.loads(result.stdout)
    assert [d["model"] for d in data] == [str(work / "models" / f"tiny{i}.onnx") for i in (0, 1)]
    assert all(d["ready"] is False and "not_quantized" in d["counts"] for d in data)
    broken = run_cli("check", work / "corrupt.onnx", cwd=tmp_path)
    assert broken.returncode == 1
    assert broken.stderr.startswith(f"error: {work / 'corrupt.onnx'}: not a valid ONNX model")


def test_a_broken_link_in_a_batch_folder_fails_on_its_own(tmp_path):
    """A ``*.onnx`` link to nothing in a model folder is not skipped without a word: that model
    fails with the reason, the others are quantized."""
    models = tmp_path / "models"
    models.mkdir()
    onnx.save(tiny_cnn(0), models / "good.onnx")
    (models / "gone.onnx").symlink_to(tmp_path / "nowhere.onnx")
    out = tmp_path / "out"
    result = run_cli("quantize", models, "-o", out, "--random-calib", "4", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "gone.onnx" in result.stderr and "Traceback" not in result.stderr
    assert (out / "good.onnx").is_file() and not (out / "gone.onnx").exists()
