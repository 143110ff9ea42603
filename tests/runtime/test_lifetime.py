"""Child processes end with their parent, even a parent killed with SIGKILL; a Ray address from
RAY_ADDRESS is checked like one given after --ray."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from quark_onnx.errors import ConfigError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (ended, not yet reaped by its new parent) counts as ended
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process model")
def test_a_child_ends_when_its_parent_is_killed(tmp_path):
    ready = tmp_path / "ready"
    child = (
        "import sys, time\n"
        "from quark_onnx.runtime.lifetime import die_with_parent\n"
        "die_with_parent(int(sys.argv[1]))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    parent = (
        "import os, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid())])\n"
        f"while not os.path.exists({str(ready)!r}):\n"
        "    time.sleep(0.05)\n"
        "print(child.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", parent, child], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 30  # a liveness bound, not a measurement
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the child outlived its killed parent"


def test_ray_address_from_the_environment_is_checked(monkeypatch):
    pytest.importorskip("ray")
    from quark_onnx.runtime import ray_cluster

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setattr(ray_cluster, "CONNECT_TIMEOUT_SECONDS", 2.0)
    ray = ray_cluster.import_ray()
    if ray.is_initialized():
        pytest.skip("a Ray session is already connected in this process")
    with (
        pytest.raises(ConfigError, match=r"RAY_ADDRESS=127\.0\.0\.1:1: nothing answers"),
        ray_cluster.connected(),
    ):
        pass
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:99999")
    with pytest.raises(ConfigError, match="not a TCP port"), ray_cluster.connected():
        pass
