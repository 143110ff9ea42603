"""Same inputs, same bytes: across processes with different hash seeds, and across threads.

The quantized model file is compared byte for byte (the report differs only in timings and
peak memory).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import shared_path
from fuzz_models import residual

CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[4])
from fuzz_models import quantizer

src, out, calib = sys.argv[1], sys.argv[2], sys.argv[3]
if calib == "random":
    quantizer(samples=4).quantize_model(src, out)
else:
    data = dict(np.load(calib, allow_pickle=False))
    quantizer(UseRandomData=False, optimize=True).quantize_model(src, out, data)
"""


def _quantize_in_subprocesses(tmp_path: Path, src: Path, calib: str) -> list[bytes]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    outputs = []
    for hash_seed in ("0", "4242"):
        out = tmp_path / f"q_{hash_seed}.onnx"
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        subprocess.run(
            [sys.executable, str(script), str(src), str(out), calib, str(Path(__file__).parent)],
            check=True,
            env=env,
            capture_output=True,
        )
        outputs.append(out.read_bytes())
    return outputs


@pytest.mark.slow
def test_same_bytes_across_hash_seeds(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(residual().SerializeToString())
    a, b = _quantize_in_subprocesses(tmp_path, src, "random")
    assert a == b
    assert b"QuantizeLinear" in a


@pytest.mark.real_model
@pytest.mark.slow
def test_same_bytes_across_hash_seeds_digits_cnn(tmp_path):
    model = shared_path("models", "digits_cnn.onnx")
    calib = np.load(shared_path("models", "digits_calib.npz"))
    np.savez(tmp_path / "calib.npz", image=calib["x"][:16])
    a, b = _quantize_in_subprocesses(tmp_path, model, str(tmp_path / "calib.npz"))
    assert hashlib.sha256(a).hexdigest() == hashlib.sha256(b).hexdigest()


def test_concurrent_quantizations_give_the_sequential_bytes(tmp_path):
    from fuzz_models import quantizer

    src = tmp_path / "m.onnx"
    src.write_bytes(residual().SerializeToString())

    def run(i: int) -> bytes:
        out = tmp_path / f"q{i}.onnx"
        quantizer(samples=3).quantize_model(src, out)
        return out.read_bytes()

    sequential = run(0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, range(1, 5)))
    assert all(r == sequential for r in results)
