"""Private temporary folders: a killed run's is removed by the next run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from quark_onnx.model_files.files import private_temp_folder


def test_a_killed_runs_temp_folder_is_removed_by_the_next_run(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"quark_onnx_reference_{gone.stdout.strip()}_x1"
    (dead / "run0").mkdir(parents=True)
    live = tmp_path / f"quark_onnx_reference_{os.getppid()}_x2"  # a running process's
    live.mkdir()
    other = tmp_path / f"quark_onnx_calib_{gone.stdout.strip()}_x3"  # another kind: not this one's
    other.mkdir()
    folder = private_temp_folder("reference")
    try:
        assert Path(folder.name).name.startswith(f"quark_onnx_reference_{os.getpid()}_")
        assert not dead.exists() and live.exists() and other.exists()
        assert "no longer runs" in caplog.text
    finally:
        folder.cleanup()
    assert not Path(folder.name).exists()
