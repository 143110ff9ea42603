"""Inputs are sacred whatever ``overwrite`` says; writers that cannot race; temporary files of
dead processes cleaned.

Every case checks the error type and message, that every input's bytes are unchanged and that
no output or staging file is left. The concurrency cases are made deterministic: the second run
is started from inside the first, after the first's checks and before its placement.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from fuzz_models import conv_chain, quantizer
from test_nothing_lost import external_model, one_error_line, run_cli

from quark_onnx.cli import jobs as cli_jobs
from quark_onnx.cli.settings import QuantizeSettings
from quark_onnx.errors import ModelSaveError, OutputAppearedError
from quark_onnx.model_files.files import atomic_write_bytes, remove_stale_partials
from quark_onnx.model_files.save import save_model


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digests(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (name -> SHA-256)."""
    return {str(p.relative_to(folder)): sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def partials(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*.partial"))


# --- 1. inputs are sacred, overwrite or not ------------------------------------------------------


def _inputs(tmp_path: Path) -> dict[str, Path]:
    """One file of each input role: the model, its external data, calibration data, a saved
    calibration result."""
    model = external_model(tmp_path / "in")
    npz = tmp_path / "in" / "calib.npz"
    np.savez(npz, x=np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32))
    saved = tmp_path / "in" / "saved.calibration.json"
    quantizer().quantize_model(model, None, calibration_data_path=npz, save_calibration=saved)
    return {"model": model, "external data": model.parent / "w.bin", "npz": npz, "saved": saved}


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("writer", ["model_output", "save_calibration"])
def test_no_writer_replaces_any_input_even_with_overwrite(tmp_path, writer, overwrite):
    files = _inputs(tmp_path)
    before = digests(tmp_path)
    for role, target in files.items():
        kwargs = {
            "calibration_data_path": files["npz"],
            "calibration_result": files["saved"],
            "overwrite": overwrite,
        }
        if writer == "model_output":
            args = (files["model"], target)
        else:
            args = (files["model"], tmp_path / "q.onnx")
            kwargs["save_calibration"] = target
        with pytest.raises(ModelSaveError, match="would destroy") as info:
            quantizer().quantize_model(*args, **kwargs)
        assert str(target.name) in str(info.value), role
        assert digests(tmp_path) == before, role
    assert not (tmp_path / "q.onnx").exists()
    assert partials(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_save_model_never_replaces_its_input_or_its_data(tmp_path, overwrite):
    files = _inputs(tmp_path)
    before = digests(tmp_path)
    model = onnx.load(str(files["model"]))
    for target in (files["model"], files["external data"]):
        with pytest.raises(ModelSaveError, match="never replaced, even with overwrite"):
            save_model(model, target, input_path=files["model"], overwrite=overwrite)
    assert digests(tmp_path) == before
    assert partials(tmp_path) == []


@pytest.mark.parametrize(
    "argv",
    [
        # quantize into the model's own folder: NAME.onnx is the input model
        ["quantize", "in/m.onnx", "-o", "in", "--random-calib", "1", "--overwrite"],
        ["export", "in/m.onnx", "--format", "onnx", "-o", "in/w.bin", "--overwrite"],
        ["export", "in/m.onnx", "--format", "onnx", "-o", "in/m.onnx", "--overwrite"],
        ["compare", "in/m.onnx", "in/m.onnx", "--random", "1", "--json", "in/m.onnx"],
        # a QDQ model named float_model.onnx imported into its own folder
        ["import", "in/float_model.onnx", "-o", "in", "--overwrite"],
    ],
    ids=[
        "quantize-into-input",
        "export-over-data",
        "export-over-model",
        "compare-json-over-model",
        "import-into-input-folder",
    ],
)
def test_cli_never_replaces_an_input(tmp_path, argv):
    files = _inputs(tmp_path)
    if argv[0] == "import":
        quantizer().quantize_model(
            files["model"], tmp_path / "in" / "float_model.onnx", calibration_data_path=files["npz"]
        )
    before = digests(tmp_path)
    proc = run_cli(*argv, cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout
    assert "would destroy" in one_error_line(proc)
    assert digests(tmp_path) == before
    assert partials(tmp_path) == []


# --- 2. writers that cannot race -----------------------------------------------------------------


def _job(tmp_path: Path, model: Path, overwrite: bool = False, **extra) -> cli_jobs.Job:
    settings = QuantizeSettings(random_samples=1, compare_samples=0, overwrite=overwrite, **extra)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return cli_jobs.Job(index=0, model=str(model), name="m", out_dir=str(out), settings=settings)


def test_two_runs_on_one_output_exactly_one_succeeds(tmp_path, monkeypatch):
    """Run B starts and ends while run A quantizes (after A's "exists" check, before A places
    its files): B wins, A fails saying the output appeared, and B's files are left intact."""
    model = tmp_path / "m.onnx"
    model.write_bytes(conv_chain().SerializeToString())
    first, second = _job(tmp_path, model), _job(tmp_path, model)
    real = cli_jobs._quantize_into
    other: list = []

    def racing(job, *args, **kwargs):
        real(job, *args, **kwargs)
        if job is first:
            other.append(cli_jobs.quantize_one(second))

    monkeypatch.setattr(cli_jobs, "_quantize_into", racing)
    loser = cli_jobs.quantize_one(first)
    (winner,) = other
    assert winner.ok, winner.message
    assert not loser.ok
    assert "appeared while this run was writing it" in loser.message
    assert "Traceback" not in loser.message and "internal error" not in loser.message
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["m.onnx", "m.report.json", "m.report.txt"]
    # the winner's model is the one in place (its report names the same output; load it)
    onnx.checker.check_model(onnx.load(str(out / "m.onnx")))
    assert partials(tmp_path) == []


def test_exclusive_placement_of_a_model_with_external_data(tmp_path, monkeypatch):
    """save_model(replace=False): if the model appears between the data file and the model
    placements, the data file this run placed is removed and the other model is untouched."""
    model = onnx.load(str(external_model(tmp_path / "in")))
    out = tmp_path / "q.onnx"
    from quark_onnx.model_files import save as save_module

    real = save_module.place_file

    def appearing(tmp, final, *, replace):
        if final == out:
            out.write_bytes(b"the other run's model")
        return real(tmp, final, replace=replace)

    monkeypatch.setattr(save_module, "place_file", appearing)
    with pytest.raises(OutputAppearedError, match="appeared"):
        save_model(model, out, external_data=True, replace=False)
    assert out.read_bytes() == b"the other run's model"
    assert not (tmp_path / "q.onnx.data").exists()
    assert partials(tmp_path) == []


def test_atomic_write_without_replace_fails_if_the_file_appeared(tmp_path):
    target = tmp_path / "r.json"
    target.write_bytes(b"first")
    with pytest.raises(OutputAppearedError, match="r.json: appeared"):
        atomic_write_bytes(target, b"second", replace=False)
    assert target.read_bytes() == b"first"
    atomic_write_bytes(target, b"second")  # replacing is the default
    assert target.read_bytes() == b"second"
    assert partials(tmp_path) == []


def test_interrupt_removes_only_this_runs_staging(tmp_path):
    """The staging folder of another (live) run writing to the same folder is left alone."""
    from quark_onnx.cli.batch import _remove_staging

    model = tmp_path / "m.onnx"
    model.write_bytes(conv_chain().SerializeToString())
    mine, theirs = _job(tmp_path, model), _job(tmp_path, model)
    own = mine.new_staging()
    other = theirs.new_staging()
    (other / "m.onnx").write_bytes(b"being written")
    _remove_staging([mine])
    assert not own.exists()
    assert (other / "m.onnx").read_bytes() == b"being written"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_partials_of_dead_processes_are_removed_with_a_note(tmp_path, caplog):
    final = tmp_path / "m.onnx"
    dead = _dead_pid()
    stale_file = tmp_path / f".m.onnx.{dead}.abcd.partial"
    stale_dir = tmp_path / f".m.onnx.{dead}.0123456789ab.partial"
    live = tmp_path / f".m.onnx.{os.getppid()}.abcd.partial"  # a running process: kept
    other = tmp_path / f".n.onnx.{dead}.abcd.partial"  # another output's: not this writer's
    stale_file.write_bytes(b"x")
    stale_dir.mkdir()
    (stale_dir / "m.onnx").write_bytes(b"x")
    live.write_bytes(b"x")
    other.write_bytes(b"x")
    with caplog.at_level("WARNING"):
        removed = remove_stale_partials(final)
    assert sorted(removed) == sorted([stale_file, stale_dir])
    assert live.exists() and other.exists()
    assert f"left by process {dead} which no longer runs" in caplog.text


def test_a_rerun_after_kill_leaves_no_partial(tmp_path):
    """What ``kill -9`` leaves (a staging folder and a temporary file named with the dead pid)
    is removed by the next run, which succeeds."""
    model = tmp_path / "m.onnx"
    model.write_bytes(conv_chain().SerializeToString())
    out = tmp_path / "out"
    out.mkdir()
    dead = _dead_pid()
    (out / f".m.onnx.{dead}.feedbeef0000.partial").mkdir()
    (out / f".m.onnx.{dead}.feedbeef0000.partial" / "m.onnx").write_bytes(b"half")
    (out / f".m.onnx.data.{dead}.1234.partial").write_bytes(b"half")
    outcome = cli_jobs.quantize_one(_job(tmp_path, model))
    assert outcome.ok, outcome.message
    assert partials(tmp_path) == []


def test_overwrite_removes_the_previous_runs_companions(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(conv_chain().SerializeToString())
    out = tmp_path / "out"
    out.mkdir()
    for name in ("m.calibration.json", "m.compare.json", "m.onnx.data", "m.report.html"):
        (out / name).write_bytes(b"the previous run's")
    (out / "m.onnx").write_bytes(b"the previous run's model")
    (out / "keep.txt").write_bytes(b"not a file of this model")
    outcome = cli_jobs.quantize_one(_job(tmp_path, model, overwrite=True))
    assert outcome.ok, outcome.message
    assert sorted(p.name for p in out.iterdir()) == [
        "keep.txt",
        "m.onnx",
        "m.report.json",
        "m.report.txt",
    ]
    assert partials(tmp_path) == []


def test_without_overwrite_an_existing_data_file_is_named(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(conv_chain().SerializeToString())
    out = tmp_path / "out"
    out.mkdir()
    (out / "m.onnx.data").write_bytes(b"someone's data")
    outcome = cli_jobs.quantize_one(_job(tmp_path, model))
    assert not outcome.ok
    assert "m.onnx.data exists; pass --overwrite" in outcome.message
    assert (out / "m.onnx.data").read_bytes() == b"someone's data"


@pytest.mark.slow
def test_two_cli_runs_started_together(tmp_path):
    """Two real processes on one output folder: exactly one exits 0; the other says the output
    exists or appeared (whichever point it reached first), and nothing partial is left."""
    (tmp_path / "m.onnx").write_bytes(conv_chain().SerializeToString())
    argv = [sys.executable, "-m", "quark_onnx", "quantize", "m.onnx", "-o", "out"]
    argv += ["--random-calib", "1", "--compare-samples", "0"]
    procs = [
        subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    results = [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 1], results
    (err,) = [text for code, text in results if code == 1]
    assert "Traceback" not in err
    assert "exists; pass --overwrite" in err or "appeared while this run" in err
    assert partials(tmp_path) == []
