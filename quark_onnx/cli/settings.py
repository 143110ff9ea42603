"""Settings: preset + ``--set KEY=VALUE`` + dedicated flags -> QuantizationConfig.

Values of ``--set`` are read as JSON literals, ``True``/``False``/``None`` as in Python, and
anything else as a string (:func:`parse_value`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from quark_onnx.cli.common import DEFAULT_PRESET
from quark_onnx.errors import ConfigError


def parse_value(text: str) -> Any:
    """A ``--set`` value: a JSON literal, ``True``/``False``/``None`` (Python spelling), else the
    text itself (a string)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    except RecursionError:
        raise ConfigError(
            f"--set value {text[:40]!r}...: nested deeper than the JSON parser accepts"
        ) from None
    python_literals = {"true": True, "false": False, "none": None}
    if text.strip().lower() in python_literals:
        return python_literals[text.strip().lower()]
    return text


def parse_assignments(items: Sequence[str]) -> list[tuple[str, Any]]:
    """``["KEY=VALUE", ...]`` -> ``[(key, parsed value), ...]`` (see :func:`parse_value`).

    Raises:
        ConfigError: an item is not ``KEY=VALUE``.
    """
    pairs: list[tuple[str, Any]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"--set {item!r}: expected KEY=VALUE (e.g. --set include_cle=true or "
                "--set ActivationSymmetric=false)"
            )
        pairs.append((key, parse_value(raw.strip())))
    return pairs


def config_field_names() -> tuple[str, ...]:
    from quark_onnx.config.quantization import QuantizationConfig

    return tuple(
        f.name for f in dataclasses.fields(QuantizationConfig) if f.name != "extra_options"
    )


def apply_assignments(qconfig: Any, pairs: Sequence[tuple[str, Any]]) -> None:
    """Apply ``--set`` pairs to a QuantizationConfig: config fields are assigned (and normalised
    by the config), other keys go to ``extra_options``. ``extra_options={...}`` merges a dict.

    Raises:
        ConfigError: a key is neither a config field nor an extra option (the closest valid name
            of either kind is named), or a value has the wrong type.
    """
    from quark_onnx.config.options import (
        UNSUPPORTED_QUARK_OPTIONS,
        did_you_mean,
        option_names,
    )

    fields = config_field_names()
    options = option_names()
    for key, value in pairs:
        if key in fields:
            setattr(qconfig, key, value)
        elif key == "extra_options":
            if not isinstance(value, dict):
                raise ConfigError(f"--set extra_options=...: expected a JSON object, got {value!r}")
            qconfig.extra_options.update(value)
        elif key in options or key in UNSUPPORTED_QUARK_OPTIONS:
            qconfig.extra_options[key] = value
        else:
            hint = did_you_mean(key, (*fields, *options))
            raise ConfigError(
                f"unknown setting {key!r} in --set{hint} (a QuantizationConfig field or an extra "
                "option: see `quark-onnx options`)"
            )
    qconfig.validate()


@dataclass(frozen=True)
class QuantizeSettings:
    """Everything a worker needs to quantize one model exactly as the others (picklable).

    The QuantizationConfig is rebuilt from these in every process, so ``--jobs`` cannot change
    what a model is quantized with.
    """

    preset: str = DEFAULT_PRESET
    assignments: tuple[tuple[str, Any], ...] = ()
    exclude: tuple[str, ...] = ()
    random_samples: int | None = None
    calib: str | None = None
    preprocess: str | None = None
    calib_limit: int | None = None
    #: None: DEFAULT_COMPARE_SAMPLES, fewer for large inputs (COMPARE_BUDGET)
    compare_samples: int | None = None
    compare_layers: bool = False
    #: FixShapes from the calibration data's one static shape (None: on for NPU configs, XINT8)
    fix_shapes_from_calib: bool | None = None
    save_calibration: bool = False
    load_calibration: str | None = None
    overwrite: bool = False
    log_level: int = logging.WARNING
    require_fidelity: bool = False
    #: extra option FidelityTarget (None: the preset's or --set's)
    fidelity_target: str | None = None
    require_ready: bool = False
    #: also write NAME.report.html (quark_onnx.pipeline.report_html)
    report_html: bool = False
    # how calibration is spread (not what is computed): the output does not depend on these
    calib_shards: int = 1
    shard_backend: str = "processes"

    def build_config(self) -> Any:
        """The QuantizationConfig: the preset, then ``--set``, then the dedicated flags."""
        from quark_onnx.config.quantization import get_default_config

        qconfig = get_default_config(self.preset)
        apply_assignments(qconfig, self.assignments)
        if self.exclude:
            qconfig.nodes_to_exclude = [*qconfig.nodes_to_exclude, *self.exclude]
        if self.random_samples is not None:
            qconfig.extra_options["UseRandomData"] = True
            qconfig.extra_options["RandomDataSamples"] = self.random_samples
        if self.calib_limit is not None:
            qconfig.extra_options["CalibDataSize"] = self.calib_limit
        if self.require_fidelity:
            qconfig.extra_options["RequireFidelity"] = True
        if self.fidelity_target is not None:
            qconfig.extra_options["FidelityTarget"] = self.fidelity_target
        qconfig.validate()
        return qconfig

    def preprocess_spec(self) -> Any:
        from quark_onnx.calibration.image_spec import PreprocessSpec

        if self.preprocess is None:
            return PreprocessSpec()
        return PreprocessSpec.parse(self.preprocess)

    def describe(self) -> str:
        """The settings a model is quantized with, in the command line's words (the summary's
        settings lines): ``--config XINT8 --calib images --preprocess '...' --set K=V``."""
        words = [f"--config {self.preset}"]
        if self.calib is not None:
            words.append(f"--calib {self.calib}")
        if self.random_samples is not None:
            words.append(f"--random-calib {self.random_samples}")
        if self.preprocess is not None:
            words.append(f"--preprocess '{self.preprocess}'")
        if self.calib_limit is not None:
            words.append(f"--calib-limit {self.calib_limit}")
        words += [f"--set {key}={json.dumps(value)}" for key, value in self.assignments]
        if self.exclude:
            words.append(f"--exclude {','.join(self.exclude)}")
        return " ".join(words)
