"""``ModelQuantizer``: the Quark-shaped entry point that runs the whole pipeline."""

from __future__ import annotations

from quark_onnx.config import Config
from quark_onnx.errors import ConfigError
from quark_onnx.options import ExtraOptions


class ModelQuantizer:
    """Quantize ONNX models with a :class:`~quark_onnx.config.Config`.

    The config is validated here: unknown or mistyped ``extra_options`` raise
    :class:`~quark_onnx.errors.ConfigError` before any model is read.
    """

    def __init__(self, config: Config) -> None:
        if not isinstance(config, Config):
            raise ConfigError(
                f"ModelQuantizer expects a quark_onnx.Config, got {type(config).__name__}"
            )
        self.config = config
        self.options: ExtraOptions = config.global_quant_config.validate()
