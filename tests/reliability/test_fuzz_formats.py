"""Fuzzing the file formats quark_onnx reads besides models: safetensors parameter files and
recipe folders. Every mutated input must load or raise a ``QuarkOnnxError``; never another
exception. The budget is small (hundreds of cases, a few seconds); ``QUARK_FUZZ_CASES`` raises it
like the model fuzzer's."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from conftest import make_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from quark_onnx.config.quantization import Config, get_default_config
from quark_onnx.errors import QuarkOnnxError
from quark_onnx.formats import safetensors_io
from quark_onnx.formats.recipe import read_recipe, save_recipe
from quark_onnx.pipeline.quantizer import ModelQuantizer

CASES = max(200, int(os.environ.get("QUARK_FUZZ_CASES", "0")) // 10)
FUZZ = settings(
    max_examples=CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _valid_file() -> bytes:
    tensors = {
        "w_scale": np.array([0.5, 0.25], np.float32),
        "w_zero_point": np.zeros(2, np.int8),
        "w_codes": np.arange(-4, 4, dtype=np.int8).reshape(2, 4),
        "b": np.ones(3, ml_dtypes.bfloat16),
    }
    return safetensors_io.serialize(tensors, {"format": "quark_onnx"})


VALID = _valid_file()

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID) - 1), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, len(VALID) - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.integers(0, 255)),
)


def _mutate(data: bytes, steps: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for kind, at, value in steps:
        at = min(at, len(out))
        if kind == "flip" and at < len(out):
            out[at] ^= value
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = bytes([value])
    return bytes(out)


@FUZZ
@given(st.lists(mutation, min_size=1, max_size=4))
def test_mutated_safetensors_load_or_raise_a_project_error(steps) -> None:
    data = _mutate(VALID, steps)
    try:
        tensors, _ = safetensors_io.deserialize(data, "fuzzed.safetensors")
    except QuarkOnnxError:
        return
    for array in tensors.values():  # what loads is well-formed arrays
        assert isinstance(array, np.ndarray)


def _tiny_recipe(folder: Path) -> None:
    rng = np.random.default_rng(0)
    model = make_model(
        [helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        {"W": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)},
    )
    qc = get_default_config("A8W8")
    qc.optimize_model = False
    feeds = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    quantized = ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model, None, feeds)
    save_recipe(folder / "r", quantized, qc, model)
    onnx.save(model, folder / "float.onnx")


def _json_edits() -> st.SearchStrategy:
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4))
    return st.lists(st.tuples(st.integers(0, 10_000), leaf), min_size=1, max_size=3)


def _edit(node: object, index: int, value: object) -> object:
    """Replace the ``index``-th (modulo the count) scalar or container in ``node``."""
    nodes: list[tuple[object, object]] = []

    def walk(parent: object) -> None:
        items = parent.items() if isinstance(parent, dict) else enumerate(parent)
        for key, child in list(items):
            nodes.append((parent, key))
            if isinstance(child, (dict, list)):
                walk(child)

    walk(node)
    if nodes:
        parent, key = nodes[index % len(nodes)]
        parent[key] = value
    return node


@FUZZ
@given(_json_edits())
def test_edited_recipe_json_loads_or_raises_a_project_error(tmp_path_factory, edits) -> None:
    base = tmp_path_factory.getbasetemp() / "recipe_fuzz_base"
    if not (base / "r").exists():
        base.mkdir(exist_ok=True)
        _tiny_recipe(base)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "r"
        shutil.copytree(base / "r", folder)
        path = folder / "recipe.json"
        document = json.loads(path.read_text(encoding="utf-8"))
        for index, value in edits:
            document = _edit(document, index, value)
        path.write_text(json.dumps(document), encoding="utf-8")
        with contextlib.suppress(QuarkOnnxError):  # any other exception fails the test
            read_recipe(folder)


# --- declared-size bombs: headers that claim far more than the file holds --------------------


@settings(max_examples=max(40, CASES // 5), deadline=None, derandomize=True)
@given(
    st.integers(0, 62),
    st.sampled_from(["I8", "F32", "F64"]),
    st.integers(0, 3),
    st.booleans(),
)
def test_safetensors_declaring_huge_tensors_are_refused_unread(exponent, code, rank, sparse):
    shape = [1 << exponent] + [1] * rank
    end = (1 << exponent) * safetensors_io.DTYPES[code].itemsize
    head = json.dumps({"t": {"dtype": code, "shape": shape, "data_offsets": [0, end]}}).encode()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "p.safetensors"
        path.write_bytes(len(head).to_bytes(8, "little") + head + b"\0" * min(end, 64))
        if sparse and end <= 1 << 30:
            with open(path, "r+b") as f:
                f.truncate(8 + len(head) + end)  # the declared bytes exist (sparse)
        try:
            tensors, _ = safetensors_io.load_file(path)
        except QuarkOnnxError:
            return
        assert tensors["t"].nbytes == end <= 1 << 30


@settings(max_examples=max(40, CASES // 5), deadline=None, derandomize=True)
@given(st.integers(0, 62), st.integers(0, 3), st.sampled_from([None, 1, 3]), st.booleans())
def test_npz_headers_declaring_huge_arrays_are_refused_or_read_within_bound(
    exponent, extra_dims, limit, npy
):
    import zipfile

    from quark_onnx.calibration.readers import load_array

    shape = (1 << exponent, *([2] * extra_dims))
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / ("c.npy" if npy else "c.npz")
        if npy:
            with open(path, "wb") as f:
                np.lib.format.write_array_header_1_0(f, header)
                f.write(b"\0" * 64)
        else:
            with zipfile.ZipFile(path, "w") as archive, archive.open("x.npy", "w") as f:
                np.lib.format.write_array_header_1_0(f, header)
                f.write(b"\0" * 64)
        try:
            array = load_array(path, None if npy else "x", limit)
        except QuarkOnnxError:
            return
        assert array.nbytes <= 64
