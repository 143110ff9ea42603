"""The record of one quantization: settings, what each stage did, positions, check, timings.

Plain data (JSON-able) so that the CLI can write it beside the output model and tools can read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class QuantizationReport:
    """What happened to one model; ``to_dict()`` is the JSON report."""

    model: str
    settings: dict[str, Any] = field(default_factory=dict)
    output: str | None = None
    passes: list[dict[str, Any]] = field(default_factory=list)
    plan: dict[str, Any] = field(default_factory=dict)
    float_nodes: list[dict[str, str]] = field(default_factory=list)
    calibration: dict[str, Any] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)
    adjustments: list[dict[str, Any]] = field(default_factory=list)
    unfixable: list[str] = field(default_factory=list)
    layer_errors: list[dict[str, Any]] = field(default_factory=list)
    bias_correction: dict[str, Any] = field(default_factory=dict)
    adaround: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    comparison: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: The process's peak RSS (MiB) when each stage ended: a high-water mark, so the stage after
    #: which it jumps is the one that set the peak (empty where the OS does not report it).
    peak_rss_mb: dict[str, float] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return float(sum(self.timings.values()))

    @property
    def ready(self) -> bool | None:
        return self.check.get("ready") if self.check else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_seconds"] = round(self.total_seconds, 4)
        return data

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as JSON, atomically."""
        from quark_onnx.model_io import atomic_write_bytes

        text = json.dumps(self.to_dict(), indent=1, sort_keys=False, default=_jsonable)
        atomic_write_bytes(path, text.encode("utf-8"))

    @property
    def npu_preset(self) -> bool:
        """The settings target the XINT8 NPU flow (``enable_npu_cnn``), to which the
        Vitis AI readiness check and the NPU position adjustments apply."""
        return bool(self.settings.get("enable_npu_cnn", True))

    def summary(self) -> str:
        """A few human-readable lines.

        The XINT8 check's findings are listed for NPU (XINT8) settings only; for float-scale
        presets the check's rules (power-of-two scales, shifts) do not apply, so one line says
        so and the findings stay in ``to_dict()["check"]``.
        """
        plan = self.plan or {}
        lines = [
            f"model: {self.model}",
            f"output: {self.output or '-'}",
            f"quantized nodes: {plan.get('quantized_nodes', 0)}, float nodes: "
            f"{plan.get('float_nodes', 0)}",
            f"calibration: {self.calibration.get('samples', 0)} sample(s), "
            f"{self.calibration.get('method', '-')}",
        ]
        if plan.get("mask_like"):
            lines.append(f"mask-like tensors kept float: {plan['mask_like']}")
        if self.npu_preset:
            lines += [
                f"NPU position adjustments: {len(self.adjustments)}, "
                f"unfixable: {len(self.unfixable)}",
                f"Vitis AI ready: {self.ready}",
                *(
                    f"  {f['severity']} {f['rule']}: {f['message']}"
                    for f in self.check.get("findings", [])
                ),
            ]
        else:
            lines.append("Vitis AI (XINT8) check: not applicable to float-scale settings")
        lines += [
            "timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()),
        ]
        if self.peak_rss_mb:
            lines.append(f"peak memory: {max(self.peak_rss_mb.values()):.0f} MiB")
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
