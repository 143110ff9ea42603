"""Ray is optional: importing quark_onnx never imports it, and ``--ray`` without it says how to
install it (these run whether or not the ``ray`` extra is installed)."""

from __future__ import annotations

import subprocess
import sys

import onnx
from cli_helpers import tiny_cnn


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_import_quark_onnx_never_imports_ray(tmp_path):
    code = (
        "import sys\n"
        "import quark_onnx, quark_onnx.cli, quark_onnx.cli.ray_runner\n"
        "import quark_onnx.calibration.shards\n"
        "quark_onnx.cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_ray_flag_without_ray_says_how_to_install_it(tmp_path):
    onnx.save(tiny_cnn(0), tmp_path / "tiny.onnx")
    # ``sys.modules['ray'] = None`` makes ``import ray`` fail as if it were not installed
    code = (
        "import sys\n"
        "sys.modules['ray'] = None\n"
        "from quark_onnx.cli import main\n"
        "sys.exit(main(['quantize', 'tiny.onnx', '-o', 'out', '--random-calib', '2', '--ray']))\n"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert lines == [
        "error: --ray needs the optional package ray, which is not installed: "
        "pip install 'quark_onnx[ray]'"
    ]
    assert not (tmp_path / "out").exists()  # refused before any model


def test_ray_flag_conflicts_with_jobs(tmp_path):
    onnx.save(tiny_cnn(0), tmp_path / "tiny.onnx")
    code = (
        "import sys\n"
        "from quark_onnx.cli import main\n"
        "sys.exit(main(['quantize', 'tiny.onnx', '-o', 'out', '--random-calib', '2', '--ray',"
        " '--jobs', '2']))\n"
    )
    result = _python(code, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "error: --ray runs every model as a Ray task: leave out --jobs" in result.stderr
