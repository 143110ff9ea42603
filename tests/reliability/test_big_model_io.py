"""Big models, CI-sized: external data in, external data out, both inside their folders.

A model above 2 GB cannot be built in CI, so the 2 GB protobuf limit of ``model_io`` and of the
calibration collector is lowered to a few kilobytes: the same code paths then run on a small
model with external data (``bench_big_model.py``, in git history, measured a 2.5 GB one).
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from fuzz_models import quantizer, residual

from quark_onnx import model_files
from quark_onnx.calibration import session as calibration_session
from quark_onnx.model_files.save import written_files


def _tree(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def _run(path_or_bytes, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(path_or_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_external_data_model_quantizes_to_external_data(tmp_path, monkeypatch):
    indir, outdir, tmp = tmp_path / "in", tmp_path / "out", tmp_path / "tmp"
    for d in (indir, outdir, tmp):
        d.mkdir()
    src = indir / "m.onnx"
    onnx.save_model(
        residual(),
        str(src),
        save_as_external_data=True,
        location="m.weights",
        size_threshold=256,
    )
    before = _tree(indir)
    assert "m.weights" in before  # the input really uses external data

    monkeypatch.setattr(model_files.external, "_PROTOBUF_LIMIT", 2048)  # "above 2 GB" from 2 kB on
    monkeypatch.setattr(model_files.save, "EXTERNAL_THRESHOLD", 64)  # int8 weights are small
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where the collector's copy goes
    made: list[str] = []
    real_save = calibration_session.save_model
    monkeypatch.setattr(
        calibration_session,
        "save_model",
        lambda m, p, **kw: (made.append(str(p)), real_save(m, p, **kw)),
    )

    out = outdir / "m.quant.onnx"
    quantized = quantizer(samples=2).quantize_model(src, out)

    assert made and all(str(tmp) in p for p in made)  # the collector used a temporary folder
    assert os.listdir(tmp) == []  # ... and removed it
    assert _tree(indir) == before  # the input folder is untouched
    files = written_files(out)
    assert [f.name for f in files] == ["m.quant.onnx", "m.quant.onnx.data"]
    assert sorted(os.listdir(outdir)) == ["m.quant.onnx", "m.quant.onnx.data"]
    header = onnx.load(str(out), load_external_data=False)
    locations = {
        e.value for t in header.graph.initializer for e in t.external_data if e.key == "location"
    }
    assert locations == {"m.quant.onnx.data"}
    x = np.random.default_rng(0).random([1, 3, 8, 8], dtype=np.float32)
    np.testing.assert_array_equal(_run(str(out), x), _run(quantized.SerializeToString(), x))


def test_small_model_is_one_file(tmp_path):
    # must not fire: below the limit the output is a single file, whatever the input was
    src = tmp_path / "m.onnx"
    onnx.save_model(
        residual(), str(src), save_as_external_data=True, location="w", size_threshold=0
    )
    out = tmp_path / "q.onnx"
    quantizer().quantize_model(src, out)
    assert [f.name for f in written_files(out)] == ["q.onnx"]
