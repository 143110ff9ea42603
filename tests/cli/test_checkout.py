"""The source tree imports as it is: from the repository root, without installing.

The repository keeps ``passes/`` and ``configs/`` at its top level; a wheel installs them as
``quark_onnx.passes`` / ``quark_onnx.configs``, a checkout reaches them through the stand-ins in
``quark_onnx/passes`` and ``quark_onnx/configs`` (:mod:`quark_onnx._checkout`). Each test starts
Python (or the CLI) with the repository root as its working directory, where ``import quark_onnx``
finds the checkout's folder before any installed copy, as Ray workers started there do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli, tiny_cnn

REPO = Path(__file__).resolve().parents[2]

#: Python as it runs in a bare checkout: whatever installed the package (an editable finder) is
#: taken out of the import system before the first import of quark_onnx.
UNINSTALLED = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.path_importer_cache.clear()
"""


def _python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", UNINSTALLED + script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_checkout_imports_uninstalled_from_the_repository_root():
    script = """
import importlib.resources, json
import quark_onnx.passes, quark_onnx.configs
from quark_onnx.passes import InsertQDQ
from quark_onnx.passes.insert_qdq import InsertQDQ as same
from quark_onnx.config.presets import preset_names
print(json.dumps({
    "package": quark_onnx.__file__,
    "passes": quark_onnx.passes.__file__,
    "pass": InsertQDQ.__module__,
    "same": InsertQDQ is same,
    "configs": sorted(p.name for p in importlib.resources.files("quark_onnx.configs").iterdir()
                      if p.name.endswith(".toml")),
    "presets": preset_names(),
}))
"""
    done = _python(script)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["package"] == str(REPO / "quark_onnx" / "__init__.py")
    assert found["passes"] == str(REPO / "passes" / "__init__.py")
    assert found["pass"] == "quark_onnx.passes.insert_qdq" and found["same"]
    assert "xint8.toml" in found["configs"]
    assert "XINT8" in found["presets"]


def test_the_cli_runs_uninstalled_from_the_repository_root(tmp_path):
    onnx.save(tiny_cnn(0), tmp_path / "m.onnx")
    script = f"""
from quark_onnx.cli import main
raise SystemExit(main(["quantize", {str(tmp_path / "m.onnx")!r}, "-o", {str(tmp_path / "out")!r},
                       "--config", "XINT8", "--random-calib", "2"]))
"""
    done = _python(script)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "m.onnx").exists()


@pytest.mark.slow
def test_the_wheel_holds_the_top_level_folders_not_the_stand_ins(tmp_path):
    """The wheel is self-contained: ``quark_onnx/passes`` and ``quark_onnx/configs`` are the
    repository's ``passes/`` and ``configs/``, the presets' files included."""
    pytest.importorskip("setuptools")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0 and (
        "No module named pip" in done.stderr or "bdist_wheel" in done.stderr
    ):
        pytest.skip("pip or the wheel package is not available")
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for folder in ("passes", "configs"):
            init = z.read(f"quark_onnx/{folder}/__init__.py")
            assert init == (REPO / folder / "__init__.py").read_bytes()
    assert "quark_onnx/passes/insert_qdq.py" in names
    assert "quark_onnx/configs/xint8.toml" in names
    assert "quark_onnx/graph/ir.py" in names


@pytest.mark.slow
def test_a_ray_batch_from_the_repository_root_writes_the_outputs_of_one_process(tmp_path):
    """``quark-onnx quantize DIR --ray`` with the repository root as working directory: its Ray
    workers import the checkout, and the outputs are byte-identical to ``--jobs 1``."""
    pytest.importorskip("ray", reason="the optional ray extra is not installed")
    models = tmp_path / "models"
    models.mkdir()
    for i in range(2):
        onnx.save(tiny_cnn(i), models / f"tiny{i}.onnx")
    x = np.random.default_rng(5).uniform(0, 1, (8, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=x)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster
    common = [models, "--calib", tmp_path / "calib.npz", "--compare-samples", "2"]
    one = run_cli("quantize", *common, "-o", tmp_path / "one", "--jobs", "1", cwd=REPO)
    assert one.returncode == 0, one.stderr
    ray = subprocess.run(
        [sys.executable, "-m", "quark_onnx", "quantize", *map(str, common),
         "-o", str(tmp_path / "ray"), "--ray"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert ray.returncode == 0, ray.stderr
    assert "No module named" not in ray.stderr
    for name in ("tiny0", "tiny1"):
        a = (tmp_path / "one" / f"{name}.onnx").read_bytes()
        assert a == (tmp_path / "ray" / f"{name}.onnx").read_bytes(), name
    assert (tmp_path / "one" / "tiny0.onnx").read_bytes() != (
        tmp_path / "one" / "tiny1.onnx"
    ).read_bytes()
