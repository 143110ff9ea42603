"""The Quark-shaped configuration API: ``QuantizationConfig``, ``Config``, ``get_default_config``.

``QuantizationConfig`` mirrors ``quark.onnx.quantization.config.QuantizationConfig``: plain
attributes that scripts assign after construction (as the seed example does). Enum-typed fields are
normalised when assigned, so ``config.activation_type = onnxruntime.quantization.QuantType.QInt8``
works and a typo fails at once. ``extra_options`` is a dict edited in place; it is validated by
:meth:`QuantizationConfig.resolved_options` when a quantizer is built.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from quark_onnx.config.enums import (
    CalibrationMethod,
    PowerOfTwoMethod,
    QuantFormat,
    QuantType,
    coerce_calibrate_method,
)
from quark_onnx.config.options import (
    ExtraOptions,
    did_you_mean,
    resolve_extra_options,
)
from quark_onnx.config.presets import read_preset
from quark_onnx.errors import ConfigError


class QuantStrategy(enum.Enum):
    """What is quantized, selected by the config (the same pipeline runs all three).

    * ``WEIGHT_ONLY`` (extra option ``WeightsOnly``): layer weights stored quantized and
      dequantized in the graph; activations float; no calibration data.
    * ``STATIC``: weights and activations; activation scales from calibration data (none for the
      float16/bfloat16 Cast types, which have no scale).
    * ``DYNAMIC`` (``use_dynamic_quant``): layer weights quantized ahead of time; the layers'
      activation inputs quantized at run time from their own range; no calibration data.
    """

    WEIGHT_ONLY = "weight_only"
    STATIC = "static"
    DYNAMIC = "dynamic"


def quant_strategy(qconfig: QuantizationConfig, options: ExtraOptions) -> QuantStrategy:
    """The strategy ``qconfig`` selects (``options``: its resolved extra options)."""
    if options.WeightsOnly:
        return QuantStrategy.WEIGHT_ONLY
    if qconfig.use_dynamic_quant:
        return QuantStrategy.DYNAMIC
    return QuantStrategy.STATIC


_LIST_FIELDS = (
    "input_nodes",
    "output_nodes",
    "op_types_to_quantize",
    "nodes_to_quantize",
    "nodes_to_exclude",
    "execution_providers",
)
_BOOL_FIELDS = (
    "per_channel",
    "reduce_range",
    "optimize_model",
    "use_external_data_format",
    "enable_npu_cnn",
    "enable_npu_transformer",
    "include_cle",
    "include_bias_correction",
    "include_fast_ft",
    "use_dynamic_quant",
    "print_summary",
)


@dataclass
class QuantizationConfig:
    """Global quantization settings (field names as in AMD Quark's ONNX QuantizationConfig).

    Attributes:
        calibrate_method: ``PowerOfTwoMethod.MinMSE``/``NonOverflow`` (power-of-two scales) or a
            ``CalibrationMethod`` (float scales).
        quant_format: only ``QuantFormat.QDQ`` is written.
        activation_type / weight_type: target data types (``QuantType``; onnxruntime's accepted):
            int8/uint8, int16/uint16, int4/uint4, float8 e4m3fn (scaled), float16/bfloat16 (Cast
            pairs, no scale). XINT8 (power-of-two) takes int8/uint8 only.
        per_channel: per-output-channel scales for the weights of Conv/ConvTranspose/Gemm/MatMul
            (per group with the extra option ``WeightBlockSize``); not with power-of-two scales.
        use_dynamic_quant: dynamic quantization (:class:`QuantStrategy`): weights ahead of time,
            the layers' activation inputs at run time; no calibration data. The extra option
            ``WeightsOnly`` selects weight-only quantization; otherwise static.
        optimize_model: simplify the float model with onnxsim first (constant folding, shapes).
        enable_npu_cnn: power-of-two scales, NPU constraint solving and DPU simulation (XINT8).
        include_cle / include_bias_correction / include_fast_ft: accuracy recovery (CLE, bias
            correction, AdaRound-style rounding).
        nodes_to_exclude / op_types_to_quantize / nodes_to_quantize: restrict what is quantized.
        execution_providers: the onnxruntime providers of the calibration session (the sessions
            that judge the result, fidelity and the accuracy replays, run on the CPU provider so
            that their reference numerics do not depend on the machine). A name onnxruntime
            does not know is refused; a known one this install lacks falls back on the next.
        use_external_data_format: write the quantized model's tensors of 1 KiB and more to
            ``<output>.data`` beside it (otherwise only models above 2 GB are split).
        print_summary: log the report's summary (logger ``quark_onnx.pipeline.quantizer``,
            INFO) when the model is written.
        input_nodes / output_nodes / reduce_range / enable_npu_transformer: accepted for
            compatibility with Quark and not supported: set to anything but the default, each
            is named in a warning and in the report's notes (:meth:`unsupported_settings`).
        extra_options: the keys of :class:`quark_onnx.config.options.ExtraOptions`.
    """

    calibrate_method: CalibrationMethod | PowerOfTwoMethod = CalibrationMethod.MinMax
    quant_format: QuantFormat = QuantFormat.QDQ
    activation_type: QuantType = QuantType.QInt8
    weight_type: QuantType = QuantType.QInt8
    input_nodes: list[str] = field(default_factory=list)
    output_nodes: list[str] = field(default_factory=list)
    op_types_to_quantize: list[str] = field(default_factory=list)
    nodes_to_quantize: list[str] = field(default_factory=list)
    nodes_to_exclude: list[str] = field(default_factory=list)
    execution_providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    per_channel: bool = False
    reduce_range: bool = False
    optimize_model: bool = True
    use_external_data_format: bool = False
    enable_npu_cnn: bool = False
    enable_npu_transformer: bool = False
    include_cle: bool = False
    include_bias_correction: bool = False
    include_fast_ft: bool = False
    use_dynamic_quant: bool = False
    print_summary: bool = True
    extra_options: dict[str, Any] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _FIELD_NAMES:
            hint = did_you_mean(name, _FIELD_NAMES)
            raise ConfigError(f"QuantizationConfig has no setting {name!r}{hint}")
        object.__setattr__(self, name, _normalise(name, value))

    def resolved_options(self) -> ExtraOptions:
        """Validate ``extra_options`` and return the effective, typed options."""
        return resolve_extra_options(self.extra_options)

    def validate(self) -> ExtraOptions:
        """Check the combination of settings; return the effective extra options."""
        options = self.resolved_options()
        check_providers(self.execution_providers)  # the list may have been edited in place
        if self.quant_format is not QuantFormat.QDQ:
            raise ConfigError(
                "quant_format: only QuantFormat.QDQ is supported (the NPU flow takes QDQ models)"
            )
        if self.enable_npu_cnn and self.per_channel:
            raise ConfigError(
                "per_channel=True conflicts with enable_npu_cnn: the NPU takes one "
                "power-of-two scale per weight tensor; set per_channel=False"
            )
        if self.enable_npu_cnn and not isinstance(self.calibrate_method, PowerOfTwoMethod):
            raise ConfigError(
                f"enable_npu_cnn needs a power-of-two calibrate_method "
                f"(PowerOfTwoMethod.MinMSE or NonOverflow), got "
                f"{self.calibrate_method}"
            )
        self._check_strategy(options)
        return options

    def _check_strategy(self, options: ExtraOptions) -> None:
        """Reject combinations of strategy, data types and granularity that cannot be written.

        Each message names the setting and the change that fixes it.
        """
        act, wt = self.activation_type, self.weight_type
        power_of_two = self.enable_npu_cnn or isinstance(self.calibrate_method, PowerOfTwoMethod)
        if power_of_two:
            where = (
                "enable_npu_cnn"
                if self.enable_npu_cnn
                else f"calibrate_method={self.calibrate_method}"
            )
            for name, qtype in (("activation_type", act), ("weight_type", wt)):
                if qtype not in _POWER_OF_TWO_TYPES:
                    raise ConfigError(
                        f"{name}={qtype} conflicts with {where}: power-of-two (XINT8) scales "
                        f"are written for {', '.join(t.name for t in _POWER_OF_TWO_TYPES)}; set "
                        f"{name} to QuantType.QInt8 or use a float calibrate_method "
                        "(CalibrationMethod.MinMax) with enable_npu_cnn=False"
                    )
            for flag in ("use_dynamic_quant",):
                if getattr(self, flag):
                    raise ConfigError(
                        f"{flag}=True conflicts with {where}: the NPU flow quantizes activations "
                        f"statically with calibrated power-of-two scales; set {flag}=False"
                    )
            if options.WeightsOnly:
                raise ConfigError(
                    f"extra option WeightsOnly=True conflicts with {where}: the NPU flow "
                    "quantizes activations too; remove WeightsOnly or use a float calibrate_method"
                )
            if self.per_channel:
                raise ConfigError(
                    f"per_channel=True conflicts with {where}: power-of-two scales are one per "
                    "tensor; set per_channel=False or use a float calibrate_method"
                )
        else:
            for flag in ("include_bias_correction", "include_fast_ft"):
                if getattr(self, flag):
                    raise ConfigError(
                        f"{flag}=True works on power-of-two (XINT8) models only; set {flag}=False "
                        "or use a PowerOfTwoMethod calibrate_method"
                    )
        if not 0 <= options.WeightScaleBits <= 23:
            raise ConfigError(
                f"extra option WeightScaleBits={options.WeightScaleBits}: give 0 (full float32 "
                "scales) or a number of significant bits from 1 to 23 (7 for exact GGUF export)"
            )
        if options.WeightBlockSize < 0:
            raise ConfigError(
                f"extra option WeightBlockSize={options.WeightBlockSize}: give a group size >= 1 "
                "(e.g. 32), or 0 for per-channel weights"
            )
        if options.WeightBlockSize and not self.per_channel:
            raise ConfigError(
                f"extra option WeightBlockSize={options.WeightBlockSize} needs per_channel=True "
                "(groups split each channel's weights); set per_channel=True, or "
                "WeightBlockSize=0 for per-tensor weights"
            )
        if wt in _CAST_TYPES and (self.per_channel or options.WeightBlockSize):
            raise ConfigError(
                f"weight_type={wt} is a Cast to a float type and has no scale, so per_channel / "
                "WeightBlockSize do not apply; set per_channel=False and WeightBlockSize=0"
            )
        for name, qtype, sym in (
            ("activation_type", act, "ActivationSymmetric"),
            ("weight_type", wt, "WeightSymmetric"),
        ):
            if qtype is QuantType.QInt32:
                raise ConfigError(f"{name}=QInt32 is for biases only; use QInt8 or QInt16")
            if qtype is QuantType.QFLOAT8E4M3FN and not getattr(options, sym):
                raise ConfigError(
                    f"{name}=QFLOAT8E4M3FN has no zero point, so it is always symmetric; set "
                    f"extra option {sym}=True"
                )
        if options.WeightsOnly and self.use_dynamic_quant:
            raise ConfigError(
                "extra option WeightsOnly=True conflicts with use_dynamic_quant=True (dynamic "
                "quantization quantizes activations at run time); choose one of the two"
            )
        if self.use_dynamic_quant:
            if act not in _DYNAMIC_TYPES:
                raise ConfigError(
                    f"use_dynamic_quant=True with activation_type={act}: run-time scales are "
                    f"computed for {', '.join(t.name for t in _DYNAMIC_TYPES)} only; set "
                    "activation_type=QuantType.QInt8 (or QUInt8), or use_dynamic_quant=False for "
                    "static quantization"
                )
            if not options.ActivationSymmetric and act is not QuantType.QUInt8:
                raise ConfigError(
                    f"use_dynamic_quant=True with ActivationSymmetric=False needs "
                    f"activation_type=QuantType.QUInt8 (DynamicQuantizeLinear), not {act}; set "
                    "ActivationSymmetric=True or activation_type=QuantType.QUInt8"
                )

    def unsupported_settings(self) -> list[str]:
        """One sentence per setting that is accepted (Quark's field names) but not supported, set
        to something other than its default: what is done instead and how to get the effect."""
        found = []
        for name in ("input_nodes", "output_nodes"):
            if getattr(self, name):
                found.append(
                    f"{name}={getattr(self, name)!r} is not supported: the whole graph is "
                    "quantized; keep nodes in float with nodes_to_exclude, or quantize only "
                    "some with nodes_to_quantize / op_types_to_quantize"
                )
        if self.reduce_range:
            found.append(
                "reduce_range=True is not supported: weights use the full range of their type "
                "(the NPU and onnxruntime's CPU kernels need no 7-bit weights); set "
                "reduce_range=False"
            )
        if self.enable_npu_transformer:
            found.append(
                "enable_npu_transformer=True is not supported: there is no transformer NPU flow; "
                "for transformers use the A16W8, A8W8 or INT8_DYNAMIC preset"
            )
        return found

    def needs_calibration_data(self) -> bool:
        """Whether quantizing with these settings reads calibration data: static integer or
        float8 activations need ranges, and the accuracy stages replay samples; weight-only,
        dynamic and float16/bfloat16 Cast settings do not."""
        options = self.resolved_options()
        if self.include_bias_correction or self.include_fast_ft or options.LayerErrorAnalysis:
            return True
        if quant_strategy(self, options) is not QuantStrategy.STATIC:
            return False
        return self.activation_type not in (QuantType.QFloat16, QuantType.QBFloat16)

    def effective_settings(self) -> dict[str, Any]:
        """Every setting in force, extra options included with their defaults filled in."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra_options":
                continue
            value = getattr(self, f.name)
            out[f.name] = (
                str(value)
                if isinstance(value, (QuantType, QuantFormat, CalibrationMethod, PowerOfTwoMethod))
                else value
            )
        try:
            out["extra_options"] = dataclasses.asdict(self.resolved_options())
        except ConfigError as exc:  # still printable while the user is editing options
            out["extra_options"] = {"<invalid>": str(exc), **self.extra_options}
        return out

    def __str__(self) -> str:
        settings = self.effective_settings()
        extra = settings.pop("extra_options")
        lines = ["QuantizationConfig("]
        lines += [
            f"    {k}={v!r}" if not isinstance(v, str) or "." not in v else f"    {k}={v}"
            for k, v in settings.items()
        ]
        lines.append("    extra_options={")
        lines += [f"        {k}: {v!r}," for k, v in extra.items()]
        lines += ["    }", ")"]
        return "\n".join(lines)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(QuantizationConfig))

#: Types the power-of-two (XINT8) flow writes for activations and weights.
_POWER_OF_TWO_TYPES = (QuantType.QInt8, QuantType.QUInt8)
#: Activation types whose scale a dynamic-quantization graph computes at run time.
_DYNAMIC_TYPES = (QuantType.QInt8, QuantType.QUInt8, QuantType.QInt16, QuantType.QUInt16)
#: Types written as a Cast pair (no scale); as ``quark_onnx.params.qparams.CAST_TYPES``.
_CAST_TYPES = (QuantType.QFloat16, QuantType.QBFloat16)


def check_providers(providers: Any) -> None:
    """Refuse an execution provider onnxruntime does not know by that name (a typo would
    otherwise be dropped with a warning, and calibration run on the CPU). A known provider this
    build lacks (CUDA on a CPU-only install) is accepted: onnxruntime falls back on the next.

    Raises:
        ConfigError: an entry is not a string, or not a name in
            ``onnxruntime.get_all_providers()`` (the message lists them).
    """
    import onnxruntime as ort

    known = list(ort.get_all_providers())
    for provider in providers:
        if not isinstance(provider, str):
            raise ConfigError(
                f"execution_providers expects a list of strings, got {provider!r} in it"
            )
        if provider not in known:
            hint = did_you_mean(provider, known)
            raise ConfigError(
                f"execution_providers: {provider!r} is not an onnxruntime execution "
                f"provider{hint} (known: {', '.join(known)})"
            )


def _normalise(name: str, value: Any) -> Any:
    if name == "calibrate_method":
        return coerce_calibrate_method(value)
    if name == "quant_format":
        return QuantFormat.coerce(value, name)
    if name in ("activation_type", "weight_type"):
        return QuantType.coerce(value, name)
    if name in _LIST_FIELDS:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} expects a list of strings, got {value!r}")
        if name == "execution_providers":
            check_providers(value)
        return list(value)
    if name in _BOOL_FIELDS and not isinstance(value, bool):
        raise ConfigError(f"{name} expects bool, got {type(value).__name__} ({value!r})")
    if name == "extra_options":
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"extra_options expects a dict, got {type(value).__name__}")
        return value  # kept as the user's dict: the seed edits it in place
    return value


@dataclass
class Config:
    """Top-level config, as ``quark.onnx.quantization.config.Config``."""

    global_quant_config: QuantizationConfig

    def __post_init__(self) -> None:
        if not isinstance(self.global_quant_config, QuantizationConfig):
            raise ConfigError(
                "Config(global_quant_config=...) expects a QuantizationConfig, got "
                f"{type(self.global_quant_config).__name__}"
            )

    def __str__(self) -> str:
        inner = str(self.global_quant_config).replace("\n", "\n    ")
        return f"Config(\n    global_quant_config={inner}\n)"


def get_default_config(name: str) -> QuantizationConfig:
    """A fresh ``QuantizationConfig`` for the named preset (a file in ``configs/``), validated.

    Raises:
        ConfigError: no such preset, or its file sets an unknown field or a wrong value (the
            message names the file and the closest valid key).
    """
    preset = read_preset(name)
    for k in preset.config:
        if k not in _FIELD_NAMES or k == "extra_options":
            hint = did_you_mean(k, _FIELD_NAMES)
            raise ConfigError(f"preset file {preset.file}: unknown [config] key {k!r}{hint}")
    qc = QuantizationConfig()
    try:
        for k, v in preset.config.items():
            setattr(qc, k, v)
        qc.extra_options = dict(preset.extra_options)
        qc.validate()
    except ConfigError as exc:
        raise ConfigError(f"preset {preset.name}: {exc}") from exc
    return qc
