"""No unsafe deserialization in the package: a static scan of every module's syntax tree.

Refused: importing ``pickle``/``cPickle``/``dill``/``marshal``/``shelve``/``joblib``; calling
``eval``, ``exec`` or ``compile``; ``yaml.load``/``yaml.unsafe_load``/``yaml.full_load`` and a
``yaml.Loader``/``UnsafeLoader``/``FullLoader``; ``np.load``/``numpy.load`` with
``allow_pickle=True`` (or any non-literal value); ``torch.load``. Config and calibration files
are JSON/NPZ read with ``json`` and ``np.load(allow_pickle=False)``. The scanner itself is tested
on snippets that must be caught and snippets that must not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import quark_onnx
from quark_onnx.errors import QuarkOnnxError

PACKAGE = Path(quark_onnx.__file__).resolve().parent
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "joblib"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_YAML = {"load", "unsafe_load", "full_load", "load_all", "unsafe_load_all"}
UNSAFE_LOADERS = {"Loader", "UnsafeLoader", "FullLoader"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def scan(source: str, filename: str = "<source>") -> list[str]:
    """Unsafe-deserialization findings in ``source``, as ``file:line: what``."""
    found: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in BANNED_MODULES:
                    hit(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in BANNED_MODULES:
                hit(node, f"from {node.module} import ...")
            if (node.module or "").split(".")[0] == "yaml":
                for alias in node.names:
                    if alias.name in UNSAFE_YAML | UNSAFE_LOADERS:
                        hit(node, f"from yaml import {alias.name}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if (
                name in BANNED_CALLS
                or name in {f"builtins.{c}" for c in BANNED_CALLS}
                or (name.startswith("yaml.") and last in UNSAFE_YAML)
            ):
                hit(node, f"{name}()")
            elif name in {"np.load", "numpy.load"}:
                for kw in node.keywords:
                    if kw.arg == "allow_pickle" and not (
                        isinstance(kw.value, ast.Constant) and kw.value.value is False
                    ):
                        hit(node, f"{name}(allow_pickle={ast.unparse(kw.value)})")
            elif name == "torch.load":
                hit(node, "torch.load()")
        elif isinstance(node, ast.Attribute) and _dotted(node) in {
            f"yaml.{loader}" for loader in UNSAFE_LOADERS
        }:
            hit(node, _dotted(node))
    return found


def test_package_has_no_unsafe_deserialization():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10  # the scan really covers the package
    findings = [f for path in files for f in scan(path.read_text(), str(path))]
    assert not findings, "unsafe deserialization:\n" + "\n".join(findings)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "import pickle as p",
        "from pickle import loads",
        "import dill",
        "import marshal",
        "eval(text)",
        "exec(code)",
        "builtins.eval('1')",
        "compile(src, 'f', 'exec')",
        "yaml.load(stream)",
        "yaml.load(stream, Loader=yaml.FullLoader)",
        "yaml.unsafe_load(stream)",
        "yaml.full_load(stream)",
        "from yaml import load",
        "np.load(path, allow_pickle=True)",
        "numpy.load(path, allow_pickle=flag)",
        "torch.load(path)",
    ],
)
def test_scanner_catches(snippet):
    assert scan(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "np.load(path, allow_pickle=False)",
        "np.load(path)",
        "yaml.safe_load(stream)",
        "json.loads(text)",
        "model.evaluate(x)",
        "ast.literal_eval(text)",
        "session.run(None, feeds)",
    ],
)
def test_scanner_allows(snippet):
    assert not scan(snippet), snippet


def _pickled_npz(tmp_path):
    import numpy as np

    path = tmp_path / "evil.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object))  # an object array is stored pickled
    return path


def test_npz_calibration_data_is_never_unpickled(tmp_path):
    from quark_onnx.calibration.readers import NpzDataReader

    with pytest.raises((ValueError, QuarkOnnxError), match="(?i)pickle|object"):
        reader = NpzDataReader(_pickled_npz(tmp_path))
        while reader.get_next() is not None:
            pass


def test_pickled_npz_is_a_calibration_error(tmp_path):
    from fuzz_models import conv_chain, quantizer

    from quark_onnx.errors import CalibrationError

    src = tmp_path / "m.onnx"
    src.write_bytes(conv_chain().SerializeToString())
    with pytest.raises(CalibrationError, match="evil.npz"):
        quantizer(UseRandomData=False).quantize_model(
            src, None, calibration_data_path=_pickled_npz(tmp_path)
        )
