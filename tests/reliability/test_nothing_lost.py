"""Nothing lost, nothing unbounded: adversarial inputs a careless user or script gives.

Every case checks the error type and its message (naming the file, option or tensor), that the
input files are byte for byte unchanged (SHA-256), that no output is left, and for the size
bombs that the process stayed below 500 MB of peak memory (measured in a fresh subprocess with
``resource.getrusage``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from fuzz_models import conv_chain, quantizer

from quark_onnx.calibration import CalibrationResult, RandomDataReader
from quark_onnx.calibration.readers import NpzDataReader
from quark_onnx.errors import (
    CalibrationError,
    ConfigError,
    ModelLoadError,
    ModelSaveError,
)
from quark_onnx.formats import safetensors_io
from quark_onnx.model_files.files import atomic_write_bytes
from quark_onnx.model_files.load import load_model
from quark_onnx.model_files.paths import check_output_path

REPO = Path(__file__).resolve().parents[2]
PEAK_MB = 500


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def external_model(folder: Path, data_name: str = "w.bin", length: int | None = None) -> Path:
    """conv_chain with every weight in ``data_name`` (``length`` overrides w0's declared length)."""
    model = conv_chain()
    folder.mkdir(parents=True, exist_ok=True)
    blob = b""
    for tensor in model.graph.initializer:
        data = tensor.raw_data
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        declared = length if (length is not None and tensor.name == "w0") else len(data)
        for key, value in (("location", data_name), ("offset", str(len(blob)))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        entry = tensor.external_data.add()
        entry.key, entry.value = "length", str(declared)
        blob += data
    (folder / data_name).write_bytes(blob)
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


#: Runs the measured script as its own child and reports that child's ``ru_maxrss`` (from
#: ``os.wait4``). Linux carries a process's peak across ``execve``, so a script started straight
#: from pytest would report pytest's own peak; this small launcher is what the child inherits.
_LAUNCHER = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
_, status, usage = os.wait4(child.pid, 0)
child.returncode = os.waitstatus_to_exitcode(status)
print("PEAK_KB", usage.ru_maxrss, flush=True)
sys.exit(child.returncode)
"""


def run_measured(code: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``code`` in a fresh interpreter; returns the process and its peak memory in MB
    (``resource.getrusage`` of that process, through :data:`_LAUNCHER`)."""
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCHER, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "tests" / "reliability")},
    )
    peak = [line for line in proc.stdout.splitlines() if line.startswith("PEAK_KB")]
    assert peak, proc.stdout + proc.stderr
    return proc, int(peak[-1].split()[1]) / 1024


def run_cli(*args: object, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quark_onnx", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# --- 1-4: outputs that would destroy an input ---------------------------------------------------


def _spellings(folder: Path, target: Path) -> list[Path]:
    """Several names of ``target``: as is, ./, through .., a symbolic link, a hard link."""
    (folder / "sub").mkdir(exist_ok=True)
    link = folder / "link.out"
    if not link.exists():
        link.symlink_to(target.name)
    hard = folder / "hard.out"
    if not hard.exists():
        os.link(target, hard)
    return [
        target,
        Path(os.path.relpath(target)) if target.is_absolute() else target,
        folder / "sub" / ".." / target.name,
        link,
        hard,
    ]


@pytest.mark.parametrize("which", ["data", "model"])
def test_output_is_never_an_input_file_whatever_its_spelling(tmp_path, which, monkeypatch):
    path = external_model(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    target = path.parent / ("w.bin" if which == "data" else "m.onnx")
    before = {p: sha(p) for p in (path, path.parent / "w.bin")}
    for out in _spellings(path.parent, target):
        with pytest.raises(ModelSaveError, match="would destroy") as info:
            quantizer().quantize_model(path, out)
        assert str(out) in str(info.value)
        assert {p: sha(p) for p in before} == before
    # with overwrite=True the model may replace itself, never its external data
    with pytest.raises(ModelSaveError, match="external data"):
        quantizer().quantize_model(path, path.parent / "w.bin", overwrite=True)
    assert {p: sha(p) for p in before} == before


def test_save_calibration_over_the_input_model_is_refused(tmp_path):
    path = external_model(tmp_path)
    before = sha(path)
    with pytest.raises(ModelSaveError, match="calibration result.*input model"):
        quantizer().quantize_model(path, tmp_path / "q.onnx", save_calibration=path)
    assert sha(path) == before
    assert not (tmp_path / "q.onnx").exists()
    with pytest.raises(ModelSaveError, match="would destroy"):
        quantizer().quantize_model(path, tmp_path / "q.onnx", save_calibration=tmp_path / "q.onnx")


def test_calibration_data_is_never_an_output(tmp_path):
    path = external_model(tmp_path)
    npz = tmp_path / "calib.npz"
    np.savez(npz, x=np.zeros((2, 3, 8, 8), np.float32))
    before = sha(npz)
    with pytest.raises(ModelSaveError, match="input file"):
        quantizer().quantize_model(path, npz, calibration_data_path=npz)
    with pytest.raises(ModelSaveError, match="input file"):
        quantizer().quantize_model(
            path, tmp_path / "q.onnx", calibration_data_path=npz, save_calibration=npz
        )
    assert sha(npz) == before


def test_fifo_and_device_outputs_are_refused(tmp_path):
    path = external_model(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ModelSaveError, match="not a regular file"):
        quantizer().quantize_model(path, fifo)
    assert fifo.is_fifo()
    with pytest.raises(ModelSaveError, match="not a regular file"):
        check_output_path("/dev/null")
    with pytest.raises(ModelSaveError, match="not a regular file"):
        atomic_write_bytes(fifo, b"x")
    assert fifo.is_fifo()


@pytest.mark.parametrize(
    ("output", "match"),
    [
        ("/dev/null/x.onnx", "not a folder"),
        ("/proc/x.onnx", "cannot write in folder"),
        ("a\0b.onnx", "NUL"),
        ("x" * 300 + ".onnx", "at most 255"),
    ],
)
def test_unwritable_output_paths_are_one_named_error(tmp_path, output, match):
    path = external_model(tmp_path)
    with pytest.raises(ModelSaveError, match=match):
        quantizer().quantize_model(path, output if "/" in output else tmp_path / output)


def test_cli_compare_json_over_the_float_model_is_refused(tmp_path):
    path = external_model(tmp_path)
    before = sha(path)
    proc = run_cli("compare", path, path, "--random", "2", "--json", path, cwd=tmp_path)
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert "--json report" in line and "would destroy" in line
    assert sha(path) == before


# --- 5: external data length vs dims ----------------------------------------------------------


def test_external_length_larger_than_dims_is_refused_before_reading(tmp_path):
    path = external_model(tmp_path, length=3 << 30)
    data = path.parent / "w.bin"
    with open(data, "r+b") as f:  # a sparse 3 GiB file: the declared range exists
        f.truncate(3 << 30)
    proc, peak = run_measured(
        f"""
        from fuzz_models import quantizer
        from quark_onnx.npu.readiness import check
        from quark_onnx.errors import ModelLoadError
        out = {str(tmp_path / "q.onnx")!r}
        for call in (lambda: check({str(path)!r}),
                     lambda: quantizer().quantize_model({str(path)!r}, out)):
            try:
                call()
            except ModelLoadError as exc:
                print("ERR", exc)
        """
    )
    assert proc.stdout.count("ERR") == 2, proc.stdout + proc.stderr
    assert "external data length 3221225472 does not match" in proc.stdout
    assert "'w0'" in proc.stdout
    assert peak <= PEAK_MB, peak
    assert not (tmp_path / "q.onnx").exists()


def test_check_refuses_a_length_that_does_not_match_the_dims(tmp_path):
    path = external_model(tmp_path, length=100)
    with pytest.raises(ModelLoadError, match="length 100 does not match"):
        load_model(path)


# --- 6: npz / npy headers ------------------------------------------------------------------------


def _npz_declaring(path: Path, shape: tuple[int, ...], data_bytes: int) -> None:
    """A deflated .npz whose member 'x' declares ``shape`` float32 and holds ``data_bytes``."""
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("x.npy", "w", force_zip64=True) as f,
    ):
        np.lib.format.write_array_header_1_0(f, header)
        zeros = bytes(16 << 20)
        left = data_bytes
        while left:
            f.write(zeros[: min(left, len(zeros))])
            left -= min(left, len(zeros))


def test_npz_is_read_lazily_with_a_limit(tmp_path):
    npz = tmp_path / "big.npz"
    rows = 400
    _npz_declaring(npz, (rows, 1 << 18), rows << 20)  # 400 MiB of zeros, deflated
    assert npz.stat().st_size < (8 << 20)
    proc, peak = run_measured(
        f"""
        from quark_onnx.calibration.readers import load_array
        a = load_array({str(npz)!r}, "x", 1)
        print("SHAPE", a.shape, float(abs(a).sum()))
        """
    )
    assert "SHAPE (1, 262144) 0.0" in proc.stdout, proc.stderr
    assert peak < 200, peak  # one row read, not 400 MiB


def test_headers_declaring_huge_arrays_are_refused_before_allocating(tmp_path):
    npz = tmp_path / "bomb.npz"
    _npz_declaring(npz, (10**12, 8), 0)
    npy = tmp_path / "bomb.npy"
    with open(npy, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 8)}
        )
    proc, peak = run_measured(
        f"""
        from quark_onnx.calibration.readers import NpzDataReader
        from quark_onnx.errors import CalibrationError
        for p in ({str(npz)!r}, {str(npy)!r}):
            try:
                NpzDataReader(p, input_name="x")
            except CalibrationError as exc:
                print("ERR", exc)
        """
    )
    assert proc.stdout.count("ERR") == 2, proc.stdout + proc.stderr
    assert "declares shape [1000000000000, 8]" in proc.stdout
    assert "--calib-limit" in proc.stdout
    assert peak <= PEAK_MB


@pytest.mark.parametrize("kind", ["empty", "truncated", "zero_d", "text"])
def test_broken_npz_files_are_calibration_errors(tmp_path, kind):
    p = tmp_path / "c.npz"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "truncated":
        np.savez(p, x=np.ones((4, 3, 8, 8), np.float32))
        p.write_bytes(p.read_bytes()[:300])
    elif kind == "zero_d":
        np.savez(p, x=np.float32(1.0))
    else:
        p.write_text("not numpy")
    with pytest.raises(CalibrationError, match=str(p)):
        NpzDataReader(p, input_name="x")


# --- 7-8: only regular files of bounded size are read ----------------------------------------


def test_calibration_result_from_dev_zero_or_fifo_is_refused_at_once(tmp_path):
    model = conv_chain()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for source in ("/dev/zero", fifo):
        with pytest.raises(CalibrationError, match="not a regular file"):
            CalibrationResult.load(source, model)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB declared
    with pytest.raises(CalibrationError, match="limit"):
        CalibrationResult.load(big, model)


def test_cli_load_calibration_dev_zero(tmp_path):
    path = external_model(tmp_path)
    proc = run_cli(
        "quantize", path, "-o", tmp_path / "out", "--load-calibration", "/dev/zero", cwd=tmp_path
    )
    assert proc.returncode == 1
    assert "not a regular file" in one_error_line(proc)
    assert not list((tmp_path / "out").iterdir())


def _recipe(tmp_path: Path) -> Path:
    from quark_onnx.formats.recipe import save_recipe

    model = conv_chain()
    q = quantizer().quantize_model(model)
    qc = quantizer().qconfig
    save_recipe(tmp_path / "r", q, qc, model)
    return tmp_path / "r"


@pytest.mark.parametrize("name", ["recipe.json", "params.safetensors"])
def test_recipe_files_linked_to_a_huge_file_are_refused_unread(tmp_path, name):
    folder = _recipe(tmp_path)
    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(50 << 30)  # sparse 50 GiB
    if name == "params.safetensors":  # a plausible header, then 50 GiB
        header = (folder / name).read_bytes()
        with open(huge, "r+b") as f:
            f.write(header[: 8 + int.from_bytes(header[:8], "little")])
    (folder / name).unlink()
    (folder / name).symlink_to(huge)
    proc, peak = run_measured(
        f"""
        from quark_onnx.formats.recipe import read_recipe
        from quark_onnx.errors import QuarkOnnxError
        try:
            read_recipe({str(folder)!r})
        except QuarkOnnxError as exc:
            print("ERR", type(exc).__name__, exc)
        """
    )
    assert "ERR" in proc.stdout, proc.stdout + proc.stderr
    assert ("limit" in proc.stdout) if name == "recipe.json" else ("declares" in proc.stdout)
    assert peak <= PEAK_MB


@pytest.mark.parametrize("where", ["recipe", "safetensors", "set"])
def test_deeply_nested_json_is_a_named_error(tmp_path, where):
    deep = "[" * 100_000 + "]" * 100_000
    if where == "safetensors":
        head = deep.encode()
        with pytest.raises(safetensors_io.SafetensorsError, match="not UTF-8 JSON"):
            safetensors_io.deserialize(len(head).to_bytes(8, "little") + head, "p.safetensors")
    elif where == "recipe":
        from quark_onnx.formats.recipe import read_recipe
        from quark_onnx.formats.recipe_format import RecipeError

        folder = tmp_path / "r"
        folder.mkdir()
        (folder / "recipe.json").write_text(deep)
        with pytest.raises(RecipeError, match="RecursionError"):
            read_recipe(folder)
    else:
        from quark_onnx.cli import parse_value

        with pytest.raises(ConfigError, match="nested deeper"):
            parse_value(deep)


# --- 9-10: numeric options, unbounded readers ------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("WeightBlockSize", 1_000_000_000),
        ("RandomDataSamples", 1_000_000_000),
        ("CalibDataSize", -1),
        ("RandomDataSeed", -3),
        ("NumBins", 0),
    ],
)
def test_numeric_options_out_of_range_name_the_option(key, value):
    with pytest.raises(ConfigError, match=f"{key}={value}"):
        quantizer(**{key: value})


def test_fast_finetune_iterations_are_bounded():
    from quark_onnx.accuracy.adaround import AdaRoundSettings

    with pytest.raises(ConfigError, match="NumIterations=1000000000000 is out of range"):
        AdaRoundSettings.from_options({"NumIterations": 10**12})


def test_random_data_for_a_huge_declared_input_is_refused():
    model = conv_chain()
    dims = model.graph.input[0].type.tensor_type.shape.dim
    for d, v in zip(dims, [1, 3, 100_000, 100_000], strict=True):
        d.dim_value = v
    with pytest.raises(CalibrationError, match="RandomDataReaderInputShape"):
        RandomDataReader(model, num_samples=1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shapes": {"x": [1, -3, 8, 8]}}, "positive integer"),
        ({"shapes": {"x": [1, 3, 2**40, 8]}}, "positive integer"),
        ({"ranges": {"x": [float("nan"), 1]}}, "finite"),
        ({"ranges": {"x": [2, 1]}}, "low < high"),
        ({"seed": -1}, "RandomDataSeed"),
        ({"num_samples": -5}, "RandomDataSamples"),
    ],
)
def test_bad_random_data_settings_are_calibration_errors(kwargs, match):
    with pytest.raises(CalibrationError, match=match):
        RandomDataReader(conv_chain(), **kwargs)


class _Endless:
    def get_next(self):
        return {"x": np.zeros((1, 3, 8, 8), np.float32)}


def test_a_reader_that_never_ends_is_capped_with_a_warning(monkeypatch, caplog):
    from quark_onnx.calibration import readers

    monkeypatch.setattr(readers, "DEFAULT_MAX_FEEDS", 5)
    q = quantizer()
    q.qconfig.extra_options.pop("UseRandomData")
    with caplog.at_level("WARNING"):
        q.quantize_model(conv_chain(), None, _Endless())
    # the cap is on what the reader gives: one of its 5 samples is held out for the verdict
    assert q.report.calibration["samples"] == 4
    assert "CalibDataSize" in caplog.text


@pytest.mark.parametrize(
    "feed", [[1, 2], np.zeros(3), "text", 7, RuntimeError("reader broke")], ids=repr
)
def test_wrong_type_readers_are_calibration_errors(feed):
    class Reader:
        def get_next(self):
            if isinstance(feed, Exception):
                raise feed
            return feed

    q = quantizer()
    q.qconfig.extra_options.pop("UseRandomData")
    with pytest.raises(CalibrationError, match="Reader"):
        q.quantize_model(conv_chain(), None, Reader())


@pytest.mark.parametrize("value", [12, b"m.onnx", ["m.onnx"]])
def test_model_input_of_the_wrong_type_is_a_config_error(value):
    with pytest.raises(ConfigError, match="model_input must be"):
        quantizer().quantize_model(value)


# --- other errors that used to escape as non-project exceptions -----------------------------


def test_unknown_tensor_data_type_is_a_load_error(tmp_path):
    model = conv_chain()
    unused = model.graph.initializer.add()
    unused.name, unused.data_type = "unused", 200
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(ModelLoadError, match="'unused'.*unknown tensor data type 200"):
        load_model(path)


def test_non_utf8_string_tensor_hashes():
    from quark_onnx.calibration.result import model_hash

    model = conv_chain()
    t = model.graph.initializer.add()
    t.name, t.data_type = "s", onnx.TensorProto.STRING
    t.dims.append(1)
    t.string_data.append(b"\xff\xfe")
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.graph.initializer[-1].string_data[0] = b"\xff\xfd"
    assert model_hash(model) != model_hash(other)


# --- 11-13: the CLI batch -----------------------------------------------------------------------


def test_a_job_failing_after_writing_leaves_nothing(tmp_path, monkeypatch, capsys):
    from quark_onnx import cli
    from quark_onnx.fidelity import compare

    path = external_model(tmp_path / "in")
    before = {p: sha(p) for p in (path, path.parent / "w.bin")}

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compare, "compare_models", broken)
    out = tmp_path / "out"
    code = cli.main(["quantize", str(path), "-o", str(out), "--random-calib", "2"])
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" not in captured.err
    assert [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert list(out.iterdir()) == []  # no model, report, or staging folder
    row = next(line for line in captured.out.splitlines() if line.startswith("m "))
    assert "failed" in row and "yes" not in row
    assert {p: sha(p) for p in before} == before
    # a rerun is not refused by a half-written earlier run
    monkeypatch.undo()
    assert cli.main(["quantize", str(path), "-o", str(out), "--random-calib", "2"]) == 0
    assert (out / "m.onnx").is_file()


@pytest.mark.parametrize(("flag", "value"), [("--calib-limit", "-1"), ("--compare-samples", "-5")])
def test_cli_count_flags_are_validated(tmp_path, flag, value, capsys):
    from quark_onnx import cli

    path = external_model(tmp_path)
    code = cli.main(
        ["quantize", str(path), "-o", str(tmp_path / "o"), "--random-calib", "2", flag, value]
    )
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} {value}" in err
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").iterdir())


def test_cli_random_calib_huge_is_refused(tmp_path):
    path = external_model(tmp_path)
    proc = run_cli("quantize", path, "-o", tmp_path / "o", "--random-calib", 10**12, cwd=tmp_path)
    assert proc.returncode == 2
    assert "RandomDataSamples=1000000000000" in one_error_line(proc)


@pytest.mark.parametrize(("signame", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_stops_the_batch_at_once_with_a_summary(tmp_path, signame, code):
    """SIGTERM to the main process (``kill``), or SIGINT to the whole process group (Ctrl-C in a
    terminal): queued jobs never start, running ones stop, a summary is printed, no process and
    no partial output is left."""
    import signal
    import time

    models = tmp_path / "models"
    for i in range(4):
        external_model(models / f"d{i}")
        os.replace(models / f"d{i}" / "m.onnx", models / f"d{i}" / f"m{i}.onnx")
    # slow enough that the jobs are still running when the signal comes
    args = [
        sys.executable,
        "-m",
        "quark_onnx",
        "quantize",
        *[str(models / f"d{i}" / f"m{i}.onnx") for i in range(4)],
        "-o",
        str(tmp_path / "out"),
        "--random-calib",
        "2000",
        "--jobs",
        "2",
    ]
    proc = subprocess.Popen(
        args,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    out_dir = tmp_path / "out"
    while time.monotonic() < deadline:
        if out_dir.exists() and list(out_dir.glob(".*.partial")):
            break
        time.sleep(0.05)
    time.sleep(0.5)
    sent = time.monotonic()
    if signame == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    elapsed = time.monotonic() - sent
    assert proc.returncode == code, stderr
    assert elapsed < 10, elapsed
    assert f"stopped by {signame}" in stderr
    assert "interrupted" in stdout  # the summary lists what was not done
    assert "Traceback" not in stderr
    assert not list(out_dir.glob(".*.partial"))  # no staging folder left
    for i in range(4):
        done = (out_dir / f"m{i}.onnx").exists()
        assert done == (out_dir / f"m{i}.report.json").exists()
    assert not list(out_dir.glob("*.partial"))
    # every worker was joined: nothing of the process group is left
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


@pytest.mark.parametrize("preset", ["XINT8", "A8W8", "INT8_DYNAMIC", "UINT4_WEIGHT_ONLY_G32"])
@pytest.mark.parametrize("extra", ["x", "w1"])
def test_a_graph_output_that_is_an_input_or_initializer_stays_float(preset, extra):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from quark_onnx import Config, ModelQuantizer, get_default_config

    model = conv_chain()
    shape = [1, 3, 8, 8] if extra == "x" else [4, 4, 1, 1]
    model.graph.output.append(helper.make_tensor_value_info(extra, TensorProto.FLOAT, shape))
    qc = get_default_config(preset)
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=1)
    quantized = ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model)
    x = np.random.default_rng(1).random((1, 3, 8, 8), dtype=np.float32)
    session = ort.InferenceSession(
        quantized.SerializeToString(), providers=["CPUExecutionProvider"]
    )
    got = dict(
        zip([o.name for o in session.get_outputs()], session.run(None, {"x": x}), strict=True)
    )
    if extra == "x":
        expected = x
    else:
        init = next(t for t in model.graph.initializer if t.name == "w1")
        expected = onnx.numpy_helper.to_array(init)
    np.testing.assert_array_equal(got[extra], expected)  # the float value, bit for bit
    assert any(
        n.op_type in ("DequantizeLinear", "DynamicQuantizeLinear") for n in quantized.graph.node
    )


def test_fix_shapes_above_int64_is_a_config_error():
    with pytest.raises(ConfigError, match="FixShapes entry"):
        quantizer(FixShapes="x:[1,3,99999999999999999999999,8]").quantize_model(conv_chain())


def test_image_folder_links_out_of_the_folder_are_not_read(tmp_path, caplog):
    from quark_onnx.calibration.image_reader import list_image_files

    outside = tmp_path / "secret.png"
    outside.write_bytes(b"\x89PNG")
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"\x89PNG")
    (folder / "b.png").symlink_to(outside)
    (folder / "c.png").symlink_to(folder / "a.png")  # a link inside the folder is fine
    with caplog.at_level("WARNING"):
        files = list_image_files(folder)
    assert [f.name for f in files] == ["a.png", "c.png"]
    assert "b.png" in caplog.text and "outside the folder" in caplog.text


@pytest.mark.parametrize("location", ["w\0.bin", "x" * 300 + ".bin"])
def test_unusable_external_locations_are_unsafe_path_errors(tmp_path, location):
    from quark_onnx.errors import UnsafePathError

    path = external_model(tmp_path)
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    path.write_bytes(model.SerializeToString())
    with pytest.raises(UnsafePathError, match="external data location"):
        load_model(path)


@pytest.mark.parametrize("out", ["/proc/quark_out", "/dev/null/x"])
def test_cli_unwritable_output_folder_is_one_error_line(tmp_path, out):
    path = external_model(tmp_path)
    proc = run_cli("quantize", path, "-o", out, "--random-calib", "1", cwd=tmp_path)
    assert proc.returncode in (1, 2)
    assert out in one_error_line(proc)
