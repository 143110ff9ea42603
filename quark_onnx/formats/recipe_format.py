"""The recipe's file format: ``recipe.json`` entries and arrays <-> configuration and parameters.

:mod:`quark_onnx.formats.recipe` saves, reads and applies recipes; this module is what their files
hold: the names and version, the configuration as JSON (:func:`config_to_json`,
:func:`config_from_json`), the parameters as ``recipe.json`` entries plus named arrays
(``<tensor>.scale``, ``<tensor>.zero_point``, ``<tensor>.codes``), checked one by one when read,
and :func:`first_difference` for the messages that say why two models differ.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quark_onnx.config.enums import QuantType
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.errors import ConfigError, QuantizationError, QuarkOnnxError
from quark_onnx.formats import safetensors_io
from quark_onnx.params import qparams
from quark_onnx.params.qparams import QuantParams

logger = logging.getLogger("quark_onnx.formats.recipe")

RECIPE_FILE = "recipe.json"
PARAMS_FILE = "params.safetensors"
FLOAT_MODEL_FILE = "float_model.onnx"
FORMAT = "quark_onnx.formats.recipe"
FORMAT_VERSION = 1
#: Largest ``recipe.json`` read (it lists each quantized tensor in a few lines; arrays are in the
#: safetensors file): a bigger file is not a recipe, and is refused before it is read.
MAX_RECIPE_BYTES = 64 << 20
_ARRAYS = ("scale", "zero_point", "codes")


class RecipeError(QuarkOnnxError):
    """A recipe cannot be written, read or applied (tampered, mismatched, malformed)."""


# ------------------------------------------------------------------------------------------------
# configuration <-> JSON
# ------------------------------------------------------------------------------------------------


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def config_to_json(qconfig: QuantizationConfig) -> dict[str, Any]:
    """Every setting of ``qconfig`` as JSON data: fields (enums by member name) and every extra
    option with its effective value (defaults filled in)."""
    settings: dict[str, Any] = {}
    for f in dataclasses.fields(qconfig):
        if f.name != "extra_options":
            settings[f.name] = _json_value(getattr(qconfig, f.name))
    options = qconfig.validate()
    return {"settings": settings, "extra_options": _json_value(dataclasses.asdict(options))}


def config_from_json(data: Any, source: str) -> QuantizationConfig:
    """The :class:`QuantizationConfig` recorded by :func:`config_to_json`.

    Raises:
        RecipeError: not an object of ``settings`` and ``extra_options``, or a setting this
            version does not know (the recipe was written by another version).
    """
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("settings"), dict)
        or not isinstance(data.get("extra_options"), dict)
    ):
        raise RecipeError(
            f"{source}: 'config' must hold the objects 'settings' and 'extra_options'"
        )
    qconfig = QuantizationConfig()
    try:
        for key, value in data["settings"].items():
            _set_setting(qconfig, key, value)
        qconfig.extra_options = dict(data["extra_options"])
        qconfig.validate()
    except ConfigError as exc:
        raise RecipeError(
            f"{source}: the recorded configuration is not valid for this version of quark_onnx "
            f"({exc}); rebuild with the version that wrote the recipe, or quantize again"
        ) from exc
    return qconfig


def _set_setting(qconfig: QuantizationConfig, key: str, value: Any) -> None:
    """Assign one recorded setting; enum values are accepted as ``Member`` or, as
    :meth:`QuantizationConfig.effective_settings` prints them, ``Class.Member``."""
    try:
        setattr(qconfig, key, value)
    except ConfigError:
        if not (isinstance(value, str) and "." in value):
            raise
        setattr(qconfig, key, value.rsplit(".", 1)[1])


# ------------------------------------------------------------------------------------------------
# params <-> arrays and JSON entries
# ------------------------------------------------------------------------------------------------


def _entries(
    params: dict[str, QuantParams], shapes: dict[str, tuple[int, ...] | None]
) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    entries: list[dict[str, Any]] = []
    arrays: dict[str, np.ndarray] = {}
    for name, p in params.items():
        entry: dict[str, Any] = {
            "name": name,
            "qtype": p.qtype.name,
            "shape": None if shapes.get(name) is None else [int(d) for d in shapes[name]],
            "axis": p.axis,
            "block_size": p.block_size,
            "dynamic": bool(p.dynamic),
            "symmetric": bool(p.symmetric),
        }
        for kind in _ARRAYS:
            value = getattr(p, kind)
            if value is None:
                entry[kind] = None
                continue
            key = f"{name}.{kind}"
            arrays[key] = np.asarray(value)
            entry[kind] = key
        entries.append(entry)
    return entries, arrays


def _params_from_entries(
    entries: Any, arrays: dict[str, np.ndarray], source: str, params_source: str
) -> tuple[dict[str, QuantParams], dict[str, tuple[int, ...] | None]]:
    if not isinstance(entries, list):
        raise RecipeError(f"{source}: 'tensors' must be a list")
    params: dict[str, QuantParams] = {}
    shapes: dict[str, tuple[int, ...] | None] = {}
    used: set[str] = set()
    for i, entry in enumerate(entries):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise RecipeError(f"{source}: tensors[{i}] has no name")
        where = f"{source}: tensor {name!r}"
        if name in params:
            raise RecipeError(f"{where} is listed twice")
        try:
            qtype = QuantType.coerce(entry.get("qtype"), "qtype")
        except QuarkOnnxError as exc:
            raise RecipeError(f"{where}: {exc}") from exc
        shape = entry.get("shape")
        if shape is not None and (
            not isinstance(shape, list)
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise RecipeError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        for key in ("axis", "block_size"):
            value = entry.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise RecipeError(f"{where}: {key} {value!r} is not an integer or null")
        for key in ("dynamic", "symmetric"):
            if not isinstance(entry.get(key), bool):
                raise RecipeError(f"{where}: {key} must be true or false")
        found: dict[str, np.ndarray | None] = {}
        for kind in _ARRAYS:
            key = entry.get(kind)
            if key is None:
                found[kind] = None
                continue
            if not isinstance(key, str) or key not in arrays:
                raise RecipeError(
                    f"{where}: its {kind} {key!r} is not in {params_source}; the recipe files do "
                    "not belong together: save the recipe again"
                )
            used.add(key)
            found[kind] = arrays[key]
        codes = found["codes"]
        if codes is not None:
            if codes.dtype != qparams.numpy_dtype(qtype):
                raise RecipeError(
                    f"{where}: codes are {codes.dtype} in {params_source}, but the recipe says "
                    f"{qtype.name}; the files were edited: restore or save the recipe again"
                )
            if shape is not None and list(codes.shape) != shape:
                raise RecipeError(
                    f"{where}: recipe.json gives shape {shape} but the codes in {params_source} "
                    f"have shape {list(codes.shape)}; the files were edited: restore them or "
                    "save the recipe again"
                )
        scale = found["scale"]
        if scale is not None and scale.dtype != np.float32:
            raise RecipeError(f"{where}: scale must be float32, found {scale.dtype}")
        p = QuantParams(
            qtype=qtype,
            scale=scale,
            zero_point=found["zero_point"],
            axis=entry.get("axis"),
            block_size=entry.get("block_size"),
            dynamic=entry["dynamic"],
            symmetric=entry["symmetric"],
            codes=codes,
        )
        try:
            p.validate(None if shape is None else tuple(shape), name)
        except QuantizationError as exc:
            raise RecipeError(
                f"{source}: {exc}; the recipe was edited or is corrupt: save it again"
            ) from exc
        params[name] = p
        shapes[name] = None if shape is None else tuple(shape)
    extra = sorted(set(arrays) - used)
    if extra:
        raise RecipeError(
            f"{params_source}: array {extra[0]!r} (and {len(extra) - 1} more) is not listed in "
            f"{source}; the files do not belong together: save the recipe again"
        )
    return params, shapes


def _roundtrip(params: dict[str, QuantParams]) -> dict[str, QuantParams]:
    """``params`` as they will read back from the files (arrays through safetensors bytes)."""
    entries, arrays = _entries(params, {})
    back, _ = safetensors_io.deserialize(safetensors_io.serialize(arrays), "<params>")
    restored, _ = _params_from_entries(entries, back, "<recipe>", "<params>")
    return restored


# ------------------------------------------------------------------------------------------------
# diagnosis
# ------------------------------------------------------------------------------------------------


def _write(
    out: Path,
    params: dict[str, QuantParams],
    shapes: dict[str, tuple[int, ...] | None],
    document: dict[str, Any],
    *,
    replace: bool = True,
) -> Path:
    """Write the parameter file, then ``recipe.json`` (last: a folder without it holds no
    recipe, so an interrupted save never leaves a half recipe that loads; ``replace=False``
    places it exclusively, failing if another run wrote one meanwhile)."""
    from quark_onnx.model_files.files import atomic_write_bytes, text_bytes

    entries, arrays = _entries(params, shapes)
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
    digest = safetensors_io.save_file(arrays, out / PARAMS_FILE, metadata)
    document = {
        **document,
        "tensors": entries,
        "params": {"file": PARAMS_FILE, "sha256": digest},
    }
    text = json.dumps(document, indent=1, ensure_ascii=False, allow_nan=False) + "\n"
    atomic_write_bytes(out / RECIPE_FILE, text_bytes(text), replace=replace)
    logger.info("recipe written to %s (%d tensors)", out, len(params))
    return out / RECIPE_FILE


def _document(
    *,
    qconfig: QuantizationConfig | None,
    preset: str | None,
    float_proto: onnx.ModelProto,
    quantized_sha: str,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from quark_onnx import __version__
    from quark_onnx.calibration.result import model_hash

    doc: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "producer": {"name": "quark_onnx", "version": __version__},
        "preset": preset,
        "config": None if qconfig is None else config_to_json(qconfig),
        "float_model": {
            "sha256": model_hash(float_proto),
            "graph_name": float_proto.graph.name,
        },
        "quantized_model": {"sha256": quantized_sha},
    }
    if source is not None:
        doc["source"] = source
    return doc


def first_difference(a: onnx.ModelProto, b: onnx.ModelProto) -> str:
    """A short description of where two models first differ (for error messages)."""
    if a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True):
        return "no difference"
    for attr in ("ir_version", "producer_name", "producer_version", "domain", "model_version"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr}: {getattr(a, attr)!r} vs {getattr(b, attr)!r}"
    if list(a.opset_import) != list(b.opset_import):
        return "opset imports differ"
    if list(a.metadata_props) != list(b.metadata_props):
        return "metadata_props differ"
    ga, gb = a.graph, b.graph
    for kind in ("input", "output"):
        la, lb = list(getattr(ga, kind)), list(getattr(gb, kind))
        if la != lb:
            return f"graph {kind}s differ ({[v.name for v in la]} vs {[v.name for v in lb]})"
    na, nb = list(ga.node), list(gb.node)
    for i, (x, y) in enumerate(zip(na, nb, strict=False)):
        if x != y:
            return (
                f"node {i}: {x.op_type} {x.name!r} {list(x.input)} vs {y.op_type} {y.name!r} "
                f"{list(y.input)}"
            )
    if len(na) != len(nb):
        return f"{len(na)} vs {len(nb)} nodes"
    ia, ib = list(ga.initializer), list(gb.initializer)
    for i, (x, y) in enumerate(zip(ia, ib, strict=False)):
        if x.name != y.name:
            return f"initializer {i}: {x.name!r} vs {y.name!r}"
        if x != y:
            return f"initializer {x.name!r}: values differ"
    if len(ia) != len(ib):
        return f"{len(ia)} vs {len(ib)} initializers"
    va, vb = list(ga.value_info), list(gb.value_info)
    if va != vb:
        for x, y in zip(va, vb, strict=False):
            if x != y:
                return f"value_info {x.name!r} vs {y.name!r}"
        return f"{len(va)} vs {len(vb)} value_info entries"
    return "graph fields differ (names, doc strings or attributes)"
