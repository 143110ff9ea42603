"""The sha256 of every quantized model the presets write on a fixed set of models and data.

Refactors must not change a single output byte; this list makes that checkable. Each case
quantizes one model with one preset (through the Python API, or through the CLI where the CLI's
own calibration sourcing is the thing under test) and records the sha256 of the written model.
``tests/test_output_hashes.py`` recomputes the cases and compares.

Regenerate after a change that is meant to change outputs (one command; it rewrites
``tests/data/output_hashes.json`` in place and prints what changed)::

    python benchmarks/output_hashes.py --write            # every case (real models too)
    python benchmarks/output_hashes.py --write --fast     # only the cases of the default test run

Without ``--write`` it compares and exits 1 on a difference.

Cases are named ``<model>/<preset>[/cli]``. The ``fast`` ones use tiny graphs built here with
seeded weights and run in the default test run; the others use ``../shared/models`` and are marked
``real_model``/``slow`` in the test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
#: the benchmark data folder: QUARK_ONNX_SHARED, else ../shared
SHARED = Path(os.environ.get("QUARK_ONNX_SHARED", REPO.parent / "shared")).resolve()
HASHES = REPO / "tests" / "data" / "output_hashes.json"

# XINT8 and the float-scale presets; the no-data presets (BF16, FP16, INT8_DYNAMIC,
# UINT4_WEIGHT_ONLY_G32) are cheap and share the save path, so they are in too.
PRESETS = (
    "XINT8",
    "A8W8",
    "A16W8",
    "U8S8",
    "FP8_E4M3",
    "INT8_DYNAMIC",
    "UINT4_WEIGHT_ONLY_G32",
    "BF16",
    "FP16",
)
REAL_PRESETS = ("XINT8", "A8W8", "A16W8", "U8S8")


@dataclass(frozen=True)
class Case:
    """One model x preset; ``run`` writes the quantized model into a folder and returns its path."""

    name: str
    fast: bool
    run: Callable[[Path], Path]
    needs: tuple[str, ...] = ()  # paths under ../shared the case reads


def _small_cnn():
    """Conv-Relu-Conv-Add(residual)-MaxPool-Concat-GlobalAveragePool-Gemm, seeded weights."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1234)

    def init(name: str, *shape: int, scale: float = 0.3) -> Any:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name
        )

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], "conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["a"], "add"),
        helper.make_node("MaxPool", ["a"], ["p"], "pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Concat", ["p", "p"], ["cat"], "cat", axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["g"], "gap"),
        helper.make_node("Flatten", ["g"], ["f"], "flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], "fc", transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "small_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])],
        [
            init("w1", 8, 3, 3, 3),
            init("b1", 8, scale=0.1),
            init("w2", 8, 8, 3, 3, scale=0.1),
            init("b2", 8, scale=0.1),
            init("wf", 5, 16),
            init("bf", 5, scale=0.1),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _small_mlp():
    """MatMul-Add-Relu-MatMul: the weight-only and dynamic presets' kind of graph."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(99)
    w1 = numpy_helper.from_array((rng.standard_normal((64, 64)) * 0.2).astype(np.float32), "w1")
    b1 = numpy_helper.from_array((rng.standard_normal(64) * 0.1).astype(np.float32), "b1")
    w2 = numpy_helper.from_array((rng.standard_normal((64, 32)) * 0.2).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], "mm1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], "add1"),
        helper.make_node("Relu", ["a1"], ["r1"], "relu1"),
        helper.make_node("MatMul", ["r1", "w2"], ["y"], "mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "small_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
        [w1, b1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _quantize_api(
    model: Any, preset: str, feeds: dict[str, np.ndarray], out: Path, batch: int = 1
) -> Path:
    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

    qc = get_default_config(preset)
    reader = ArrayDataReader(feeds, batch_size=batch)
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(model, str(out), reader)
    return out


def _quantize_cli(args: list[str], out_dir: Path, stem: str) -> Path:
    from quark_onnx.cli import main

    code = main(["quantize", *args, "-o", str(out_dir), "--quiet"])
    if code != 0:
        raise RuntimeError(f"quark-onnx quantize {' '.join(args)} exited {code}")
    return out_dir / f"{stem}.onnx"


def _small_case(builder: Callable[[], Any], tag: str, preset: str, shape: tuple) -> Case:
    def run(folder: Path) -> Path:
        import onnx

        src = folder / f"{tag}.onnx"
        onnx.save(builder(), src)
        # eight feeds of the model's static batch size
        x = np.random.default_rng(7).standard_normal((8 * shape[0], *shape[1:]))
        feeds = {"x": x.astype(np.float32)}
        out = folder / f"{tag}.{preset}.onnx"
        return _quantize_api(str(src), preset, feeds, out, batch=shape[0])

    return Case(f"{tag}/{preset}", True, run)


def _small_cli_case() -> Case:
    """The CLI's own npz sourcing and batch runner on the small CNN."""

    def run(folder: Path) -> Path:
        import onnx

        models = folder / "models"
        models.mkdir()
        onnx.save(_small_cnn(), models / "small_cnn.onnx")
        x = np.random.default_rng(7).standard_normal((8, 3, 16, 16)).astype(np.float32)
        np.savez(folder / "calib.npz", x=x)
        return _quantize_cli(
            [str(models / "small_cnn.onnx"), "--calib", str(folder / "calib.npz")],
            folder / "out",
            "small_cnn",
        )

    return Case("small_cnn/XINT8/cli", True, run)


def _digits_case(preset: str) -> Case:
    def run(folder: Path) -> Path:
        calib = np.load(SHARED / "models" / "digits_calib.npz")["x"][:32]
        model = str(SHARED / "models" / "digits_cnn.onnx")
        return _quantize_api(model, preset, {"image": calib}, folder / f"digits.{preset}.onnx")

    return Case(f"digits_cnn/{preset}", False, run, ("models/digits_cnn.onnx",))


def _squeezenet_cli_case(preset: str) -> Case:
    """SqueezeNet calibrated from JPEGs through the CLI's image reader (BGR, Caffe mean)."""

    def run(folder: Path) -> Path:
        images = folder / "images"
        images.mkdir()
        for jpg in sorted((SHARED / "data" / "imagenet" / "calib").glob("*.JPEG"))[:4]:
            shutil.copyfile(jpg, images / jpg.name)
        return _quantize_cli(
            [
                str(SHARED / "models" / "squeezenet1.1.onnx"),
                "--config",
                preset,
                "--calib",
                str(images),
                "--preprocess",
                "resize=256,crop=224,mean=104;117;123,order=BGR",
            ],
            folder / "out",
            "squeezenet1.1",
        )

    return Case(
        f"squeezenet1.1/{preset}/cli",
        False,
        run,
        ("models/squeezenet1.1.onnx", "data/imagenet/calib"),
    )


def _mobilenet_case(preset: str) -> Case:
    def run(folder: Path) -> Path:
        x = np.random.default_rng(3).standard_normal((4, 3, 224, 224)).astype(np.float32)
        model = str(SHARED / "models" / "mobilenetv2_rebuilt.onnx")
        return _quantize_api(model, preset, {"input": x}, folder / f"mobilenetv2.{preset}.onnx")

    return Case(f"mobilenetv2/{preset}", False, run, ("models/mobilenetv2_rebuilt.onnx",))


def _every_rule_op():
    """The test graph holding every NPU rule op (``tests/npu/graphs.py``)."""
    sys.path.insert(0, str(REPO / "tests" / "npu"))
    from graphs import build

    return build()


def _shared_case(tag: str, model: str, name: str, shape: tuple, scale: float) -> Case:
    """XINT8 on a shared model, calibrated on four seeded random arrays of ``shape``."""

    def run(folder: Path) -> Path:
        x = np.random.default_rng(5).standard_normal((4, *shape)) * scale
        path = str(SHARED / "models" / model)
        return _quantize_api(path, "XINT8", {name: x.astype(np.float32)}, folder / f"{tag}.onnx")

    return Case(f"{tag}/XINT8", False, run, (f"models/{model}",))


def cases() -> list[Case]:
    out = [_small_case(_small_cnn, "small_cnn", p, (1, 3, 16, 16)) for p in PRESETS]
    out += [_small_case(_small_mlp, "small_mlp", p, (4, 64)) for p in PRESETS]
    out.append(_small_case(_every_rule_op, "every_rule_op", "XINT8", (1, 3, 16, 16)))
    out.append(_small_cli_case())
    out += [_digits_case(p) for p in PRESETS]
    out += [_squeezenet_cli_case(p) for p in REAL_PRESETS]
    out += [_mobilenet_case(p) for p in ("XINT8", "A8W8")]
    out.append(
        _shared_case("person_detector", "person_detector_192.onnx", "images", (3, 192, 192), 64.0)
    )
    out.append(_shared_case("ppocr", "ppocr_direction_cls.onnx", "x", (3, 48, 192), 0.5))
    return out


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_case(case: Case) -> str:
    """The sha256 of the model ``case`` writes (in a fresh temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="quark_onnx_hash_") as tmp:
        return sha256_of(case.run(Path(tmp)))


def load_hashes() -> dict[str, str]:
    return json.loads(HASHES.read_text()) if HASHES.exists() else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {HASHES.relative_to(REPO)}")
    parser.add_argument("--fast", action="store_true", help="only the cases of the default run")
    parser.add_argument("-k", metavar="SUBSTRING", help="only cases whose name contains this")
    args = parser.parse_args(argv)
    stored = load_hashes()
    fresh = dict(stored)
    changed = 0
    for case in cases():
        if (args.fast and not case.fast) or (args.k and args.k not in case.name):
            continue
        if any(not (SHARED / p).exists() for p in case.needs):
            print(f"skip   {case.name} (../shared missing)")
            continue
        digest = run_case(case)
        fresh[case.name] = digest
        status = (
            "same"
            if stored.get(case.name) == digest
            else "NEW"
            if case.name not in stored
            else "CHANGED"
        )
        changed += status != "same"
        print(f"{status:7s}{case.name} {digest[:16]}")
    if args.write:
        HASHES.parent.mkdir(parents=True, exist_ok=True)
        tmp = HASHES.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(sorted(fresh.items())), indent=1) + "\n")
        tmp.replace(HASHES)
        print(f"wrote {HASHES} ({changed} changed)")
        return 0
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
