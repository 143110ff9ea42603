"""``quark-onnx quantize --manifest models.toml -o OUT``: a batch whose models each have their own
file, calibration data, pre-processing, preset and options.

A manifest is TOML: settings at the top are the defaults of every model, and each ``[[model]]``
table names its ``file`` and the settings it changes::

    preset = "XINT8"
    calib = "images/"                      # relative paths: from the manifest's folder
    set = { CalibDataSize = 64 }

    [[model]]
    file = "squeezenet.onnx"
    preprocess = "resize=256,crop=224,mean=104;117;123,order=BGR"

    [[model]]
    file = "mobilenet.onnx"
    name = "mobilenet_v2"                  # the output name (default: the file's stem)
    preprocess = "resize=256,crop=224,scale=1/255,mean=0.485;0.456;0.406,std=0.229;0.224;0.225"
    set = { include_cle = true }           # added to the defaults' set

The settings are those of the command line: ``preset`` (``--config``), ``calib``,
``random_calib``, ``preprocess``, ``calib_limit``, ``exclude`` (a list of node names) and ``set``
(a table of QuantizationConfig fields and extra options, the values as TOML writes them). A model
quantized from a manifest is quantized exactly as the single run with the same flags.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quark_onnx.cli.settings import QuantizeSettings
from quark_onnx.errors import ConfigError

#: Settings a manifest may give at the top (defaults) or per model, with their types.
SETTING_TYPES: dict[str, type | tuple[type, ...]] = {
    "preset": str,
    "calib": str,
    "random_calib": int,
    "preprocess": str,
    "calib_limit": int,
    "exclude": list,
    "set": dict,
}
#: What only a ``[[model]]`` table gives.
MODEL_TYPES: dict[str, type | tuple[type, ...]] = {"file": str, "name": str}


@dataclass(frozen=True)
class BatchModel:
    """One model of a batch (a manifest's, or of the command line): its file, output name and
    the settings it is quantized with."""

    model: Path
    name: str
    settings: QuantizeSettings


def _checked(table: dict[str, Any], allowed: dict[str, Any], where: str) -> dict[str, Any]:
    from quark_onnx.config.options import did_you_mean

    for key, value in table.items():
        if key not in allowed:
            hint = did_you_mean(key, list(allowed))
            raise ConfigError(
                f"{where}: unknown key {key!r}{hint} (one of {', '.join(sorted(allowed))})"
            )
        kind = allowed[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise ConfigError(f"{where}: {key} = {value!r}: expected a {name}")
    if "exclude" in table and not all(isinstance(n, str) for n in table["exclude"]):
        raise ConfigError(f"{where}: exclude: expected a list of node names (strings)")
    return table


def _apply(settings: QuantizeSettings, table: dict[str, Any], folder: Path) -> QuantizeSettings:
    """``settings`` with the manifest settings of ``table`` (paths relative to ``folder``)."""
    changes: dict[str, Any] = {}
    if "preset" in table:
        changes["preset"] = table["preset"]
    if "calib" in table:  # one calibration source: a model's own replaces the default's
        changes.update(calib=str((folder / table["calib"]).resolve()), random_samples=None)
    if "random_calib" in table:
        changes.update(random_samples=table["random_calib"], calib=None)
    if "preprocess" in table:
        changes["preprocess"] = table["preprocess"]
    if "calib_limit" in table:
        changes["calib_limit"] = table["calib_limit"]
    if "exclude" in table:
        changes["exclude"] = (*settings.exclude, *table["exclude"])
    if "set" in table:
        changes["assignments"] = (*settings.assignments, *table["set"].items())
    return dataclasses.replace(settings, **changes)


#: Largest manifest read (a list of models and settings: 16 MiB is thousands of models).
MAX_MANIFEST_BYTES = 16 << 20


def read_manifest(path: str | os.PathLike, base: QuantizeSettings) -> list[BatchModel]:
    """The models of the manifest at ``path``, each with ``base`` (the command line's run
    settings) changed by the manifest's defaults, then by its own table.

    Raises:
        ConfigError: the file is missing or not TOML, a key is unknown or of the wrong type, a
            model has no ``file``, or there is no model.
    """
    from quark_onnx.config.presets import _tomllib
    from quark_onnx.model_files.files import read_regular_file

    manifest = Path(path)
    # a FIFO or device is refused unread, a file above the cap from its size
    raw = read_regular_file(
        manifest, limit=MAX_MANIFEST_BYTES, what="manifest", error=ConfigError, option="--manifest"
    )
    try:
        data = _tomllib().loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--manifest {manifest}: cannot read it ({exc})") from None
    except ValueError as exc:  # tomllib.TOMLDecodeError
        raise ConfigError(f"--manifest {manifest}: not valid TOML: {exc}") from None
    models = data.pop("model", None)
    if not isinstance(models, list) or not models:
        raise ConfigError(
            f"--manifest {manifest}: no [[model]] table (each model is a [[model]] table with "
            'its file = "...")'
        )
    folder = manifest.resolve().parent
    defaults = _apply(base, _checked(data, SETTING_TYPES, f"{manifest} (defaults)"), folder)
    entries = []
    for i, table in enumerate(models, 1):
        where = f"{manifest}, model {i}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: expected a [[model]] table")
        table = _checked(table, {**SETTING_TYPES, **MODEL_TYPES}, where)
        if "file" not in table:
            raise ConfigError(f'{where}: no file = "MODEL.onnx"')
        model = folder / table["file"]
        name = table.get("name") or (model.stem if model.suffix.lower() == ".onnx" else model.name)
        entries.append(BatchModel(model, name, _apply(defaults, table, folder)))
    return entries
