"""Refusals of the operating system the user can act on are one named line, never an internal
error: a path too long for the file system (a name above NAME_MAX, a path above PATH_MAX) in any
file argument, and a standard output that cannot be written (``> /dev/full``)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import onnx
import pytest
from cli_helpers import tiny_cnn

from quark_onnx.cli import main

LONG_NAME = "n" * 300  # above NAME_MAX (255)
LONG_PATH = "/".join(["d" * 200] * 25)  # about 5,000 bytes: above PATH_MAX (4096)


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(tiny_cnn(0), path)
    return path


def _commands(tmp_path, model, long: str) -> list[list[str]]:
    out = str(tmp_path / "out")
    return [
        ["quantize", str(tmp_path / f"{long}.onnx"), "-o", out, "--random-calib", "2"],
        ["quantize", str(model), "-o", str(tmp_path / long), "--random-calib", "2"],
        ["quantize", str(model), "-o", out, "--calib", str(tmp_path / f"{long}.npz")],
        ["check", str(tmp_path / f"{long}.onnx")],
        ["import", str(tmp_path / long), "-o", str(tmp_path / "x.onnx")],
        ["export", str(tmp_path / f"{long}.onnx"), "-o", out, "--format", "recipe"],
        ["compare", str(model), str(tmp_path / f"{long}.onnx"), "--random", "2"],
    ]


@pytest.mark.parametrize("long", [LONG_NAME, LONG_PATH], ids=["name", "path"])
def test_a_path_too_long_is_one_named_line(tmp_path, model, capsys, long):
    before = sorted(os.listdir(tmp_path))
    for argv in _commands(tmp_path, model, long):
        code = main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code in (1, 2), (argv[0], err)
        assert len(lines) == 1 and "internal error" not in err and "Traceback" not in err, err
        # the path named (its beginning: a 5,000-byte path is not printed whole)
        assert str(tmp_path)[:40] in lines[0], lines[0]
        assert "too long" in lines[0] or "bytes long" in lines[0], lines[0]
    assert sorted(os.listdir(tmp_path)) == before  # nothing left behind (no "out" folder)


class _FullStream:
    """A standard output on a full disk."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("argv", [["presets"], ["options"], ["check"]])
def test_a_standard_output_that_cannot_be_written_is_named(model, capsys, monkeypatch, argv):
    argv = [*argv, str(model)] if argv == ["check"] else argv
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", _FullStream())
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 1
    assert err.splitlines() == [
        "error: cannot write to the standard output (No space left on device): the results "
        "are not printed; redirect the output to a writable file"
    ]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_dev_full_as_a_user_meets_it(tmp_path):
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "quark_onnx", "presets"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            timeout=120,
        )
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot write to the standard output")
    assert len(done.stderr.splitlines()) == 1  # no "Exception ignored" at exit
