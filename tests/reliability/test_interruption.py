"""Nothing lost: the input is never replaced, outputs appear whole or not at all.

Interrupted runs are tested for real: a child process saves or quantizes in a loop and is sent
``SIGTERM`` or ``SIGINT`` at a random moment, many times. After each kill no temporary file
(``*.partial``, calibration temp folders) remains, the input is byte-identical, and the output is
either absent or a complete model that loads and runs.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from fuzz_models import conv_chain, quantizer

from quark_onnx.errors import ModelSaveError
from quark_onnx.model_files.load import load_model

CHILD = r"""
import sys
from pathlib import Path

import numpy as np

from quark_onnx.model_files.files import sigterm_as_interrupt
from quark_onnx.model_files.load import load_model
from quark_onnx.model_files.save import save_model

mode, src, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from fuzz_models import quantizer

with sigterm_as_interrupt():
    if mode == "save":
        model = load_model(src)
        print("ready", flush=True)
        for i in range(100000):
            # alternate one file and model + external data
            save_model(model, out, input_path=src, external_data=bool(i % 2))
    else:
        q = quantizer(samples=2)
        print("ready", flush=True)
        for i in range(100000):
            q.quantize_model(src, out)
"""


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _big_model() -> onnx.ModelProto:
    """conv_chain plus a 16 MB side branch, so that one save takes a few milliseconds."""
    model = conv_chain()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4 * 8 * 8, 65536)).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(w, "big"))
    model.graph.initializer.append(
        onnx.numpy_helper.from_array(np.array([1, 256], np.int64), "flat_shape")
    )
    model.graph.node.extend(
        [
            onnx.helper.make_node("Reshape", ["y", "flat_shape"], ["flat"]),
            onnx.helper.make_node("MatMul", ["flat", "big"], ["z"]),
        ]
    )
    model.graph.output.append(
        onnx.helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [1, 65536])
    )
    return model


def _assert_clean(folder: Path, tmpdir: Path, src: Path, digest: str, out: Path) -> None:
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temporary files left: {leftovers}"
    # onnxruntime keeps a session-id file ``.ses`` in TMPDIR; it is not a temporary of ours
    temps = [p.name for p in tmpdir.iterdir() if p.name != ".ses"]
    assert not temps, f"temporary files or folders left in TMPDIR: {temps}"
    assert _digest(src) == digest, "the input model changed"
    if out.exists():
        model = load_model(out)  # complete: parses, passes the checker, data present
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        x = np.random.default_rng(0).random([1, 3, 8, 8], dtype=np.float32)
        assert all(np.isfinite(o).all() for o in session.run(None, {"x": x}))


def _kill_loop(tmp_path: Path, mode: str, model: onnx.ModelProto, rounds: int, window: float):
    folder = tmp_path / "work"
    folder.mkdir()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    src = folder / "in.onnx"
    src.write_bytes(model.SerializeToString())
    digest = _digest(src)
    out = folder / "out.onnx"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, TMPDIR=str(tmpdir))
    rnd = random.Random(1234)
    interrupted = 0
    for i in range(rounds):
        sig = (signal.SIGTERM, signal.SIGINT)[i % 2]
        proc = subprocess.Popen(
            [sys.executable, str(script), mode, str(src), str(out), str(Path(__file__).parent)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        try:
            assert proc.stdout.readline().strip() == b"ready", proc.stderr.read().decode()
            time.sleep(rnd.uniform(0.0, window))
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert b"KeyboardInterrupt" in err or b"Terminated" in err, err.decode()[-2000:]
        interrupted += 1
        _assert_clean(folder, tmpdir, src, digest, out)
    assert interrupted == rounds


@pytest.mark.slow
def test_kill_during_save_leaves_no_partial_output(tmp_path):
    _kill_loop(tmp_path, "save", _big_model(), rounds=8, window=0.4)


@pytest.mark.slow
def test_kill_during_quantize_leaves_no_partial_output(tmp_path):
    _kill_loop(tmp_path, "quantize", conv_chain(), rounds=4, window=1.0)


def test_output_equal_to_input_is_refused_even_with_overwrite(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(conv_chain().SerializeToString())
    before = _digest(src)
    q = quantizer()
    for same in (src, tmp_path / "." / "m.onnx"):
        with pytest.raises(ModelSaveError, match="input model"):
            q.quantize_model(same, same)
        assert _digest(src) == before
    link = tmp_path / "link.onnx"
    link.symlink_to(src)
    with pytest.raises(ModelSaveError, match="input model"):
        q.quantize_model(src, link)
    assert _digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.onnx", "m.onnx"]
    with pytest.raises(ModelSaveError, match="never replaced, even with overwrite"):
        q.quantize_model(src, src, overwrite=True)
    assert _digest(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.onnx", "m.onnx"]


def test_report_and_calibration_files_are_atomic(tmp_path, monkeypatch):

    src = tmp_path / "m.onnx"
    src.write_bytes(conv_chain().SerializeToString())
    q = quantizer()
    q.quantize_model(src, tmp_path / "q.onnx", save_calibration=tmp_path / "calib.json")
    q.report.save(tmp_path / "report.json")
    real = os.replace

    def interrupted(a, b):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        q.report.save(tmp_path / "report2.json")
    monkeypatch.setattr(os, "replace", real)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["calib.json", "m.onnx", "q.onnx", "report.json"]


def test_interrupt_right_after_the_temporary_file_is_created_removes_it(tmp_path, monkeypatch):
    """A signal landing between the creation of the temporary file and the return of the call
    that created it (seen once under load in the kill loop above) leaves nothing behind."""
    from quark_onnx.model_files import files

    real_open = files.os.open

    def open_then_interrupt(*args, **kwargs):
        real_open(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "open", open_then_interrupt)
    target = tmp_path / "out.onnx"
    with pytest.raises(KeyboardInterrupt):
        files.atomic_write_bytes(target, b"data")
    assert list(tmp_path.iterdir()) == []
    assert not files._LIVE_TEMPS
