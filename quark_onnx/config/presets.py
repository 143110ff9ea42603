"""Named presets: TOML files in ``configs/`` (installed as ``quark_onnx.configs``).

A preset file has a ``description`` (required: what the preset is for), a ``[config]`` table of
:class:`~quark_onnx.config.quantization.QuantizationConfig` fields and an ``[extra_options]`` table.
Both are checked against the same schema as user code (unknown keys name the closest valid key) when
:func:`quark_onnx.config.quantization.get_default_config` builds the configuration, so adding a
preset is adding a file. TOML is parsed with the standard library's ``tomllib``: data only, nothing
executed. This module reads files only; it does not import :mod:`quark_onnx.config.quantization`
(which builds a configuration from a :class:`Preset`), so the two do not import each other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from quark_onnx.config.options import did_you_mean
from quark_onnx.errors import ConfigError

_TOP_KEYS = ("name", "description", "config", "extra_options")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: dict[str, Any]
    extra_options: dict[str, Any]
    #: the file's name, for messages
    file: str = ""


def _tomllib() -> Any:
    # imported on first use: ``import quark_onnx`` imports this module and stays fast
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    return tomllib


def _preset_files() -> dict[str, Any]:
    import importlib.resources

    root = importlib.resources.files("quark_onnx.configs")
    return {p.name[: -len(".toml")].upper(): p for p in root.iterdir() if p.name.endswith(".toml")}


def preset_names() -> list[str]:
    """Names accepted by :func:`get_default_config`, sorted."""
    return sorted(_preset_files())


def read_preset(name: str) -> Preset:
    """Parse and schema-check the preset file for ``name`` (case-insensitive)."""
    files = _preset_files()
    key = name.upper() if isinstance(name, str) else name
    if key not in files:
        hint = did_you_mean(str(name), files)
        raise ConfigError(f"unknown preset {name!r}{hint} (presets: {', '.join(sorted(files))})")
    path = files[key]
    tomllib = _tomllib()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"preset file {path.name}: invalid TOML: {exc}") from exc
    for k in data:
        if k not in _TOP_KEYS:
            hint = did_you_mean(k, _TOP_KEYS)
            raise ConfigError(f"preset file {path.name}: unknown key {k!r}{hint}")
    config = data.get("config", {})
    description = data.get("description", "")
    if not isinstance(description, str) or not description.strip():
        raise ConfigError(
            f"preset file {path.name}: add a 'description' saying what the preset is for"
        )
    return Preset(
        name=data.get("name", key),
        description=description,
        config=config,
        extra_options=dict(data.get("extra_options", {})),
        file=path.name,
    )


def preset_descriptions() -> dict[str, str]:
    """Preset name -> its description (what it is for), sorted by name."""
    return {name: read_preset(name).description for name in preset_names()}
