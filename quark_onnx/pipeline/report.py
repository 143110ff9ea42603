"""The record of one quantization: settings, what each stage did, positions, check, timings.

Plain data (JSON-able) so that the CLI can write it beside the output model and tools can read it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from quark_onnx.npu.findings import group_lines


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
    #: Activations an NPU rule clips to less than half their calibrated range (XINT8).
    range_clips: list[dict[str, Any]] = field(default_factory=list)
    #: Activations an NPU rule moved off their calibrated position, with the loss of their own
    #: SQNR (:func:`quark_onnx.npu.costs.forced_position_costs`), largest first (XINT8).
    position_costs: list[dict[str, Any]] = field(default_factory=list)
    layer_errors: list[dict[str, Any]] = field(default_factory=list)
    bias_correction: dict[str, Any] = field(default_factory=dict)
    adaround: dict[str, Any] = field(default_factory=dict)
    check: dict[str, Any] = field(default_factory=dict)
    comparison: dict[str, Any] = field(default_factory=dict)
    #: The fidelity guard's verdict (:meth:`quark_onnx.fidelity.verdict.FidelityResult.to_dict`):
    #: every output against the original float model; empty when it did not run.
    fidelity: dict[str, Any] = field(default_factory=dict)
    #: What the fidelity repair tried when the guard found an output not faithful, or the
    #: refinement offered to a faithful result, one entry per attempt
    #: (:func:`quark_onnx.pipeline.repair.repair`): its settings, fidelity and whether it was kept.
    repairs: list[dict[str, Any]] = field(default_factory=list)
    #: The mixed-precision search or list (:mod:`quark_onnx.pipeline.mixed_precision`): the
    #: target, the tensors promoted with their measured share of the error, the share of the
    #: activation tensors promoted, the CPU islands and their NPU/CPU transitions, each attempt.
    mixed_precision: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    #: The process's peak RSS (MiB, ``getrusage`` ``ru_maxrss``) when each stage ended: a
    #: high-water mark, so the stage after which it jumps is the one that set the peak, and the
    #: last value is the process's peak so far (empty where the OS does not report it). The CLI
    #: adds its ``compare`` stage.
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    #: Decisions taken for the user that change the written model (e.g. FixShapes taken from the
    #: calibration data), one sentence each.
    notes: list[str] = field(default_factory=list)

    @property
    def total_seconds(self) -> float:
        return float(sum(self.timings.values()))

    @property
    def process_peak_rss_mb(self) -> float | None:
        """The process's high-water mark when the last recorded stage ended (MiB)."""
        return max(self.peak_rss_mb.values()) if self.peak_rss_mb else None

    @property
    def ready(self) -> bool | None:
        return self.check.get("ready") if self.check else None

    @property
    def faithful(self) -> bool | None:
        """The fidelity guard's verdict (None when it did not run)."""
        return self.fidelity.get("faithful") if self.fidelity else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["total_seconds"] = round(self.total_seconds, 4)
        data["process_peak_rss_mb"] = self.process_peak_rss_mb
        return data

    def save(self, path: str | os.PathLike) -> None:
        """Write the report as JSON, atomically."""
        from quark_onnx.model_files.files import atomic_write_bytes, text_bytes

        text = json.dumps(self.to_dict(), indent=1, sort_keys=False, default=_jsonable)
        atomic_write_bytes(path, text_bytes(text))

    @property
    def reverted_passes(self) -> dict[str, str]:
        """The graph passes this run measured and undid (``RevertCostlyPasses``), each with what
        it cost: the readiness check does not propose them (:func:`quark_onnx.npu.readiness.check`
        ``reverted_passes``)."""
        undone = {}
        for record in self.passes:
            if not record.get("reverted"):
                continue
            costs = [o["sqnr_db"] for o in record.get("fidelity", []) if "sqnr_db" in o]
            worst = min(costs, key=float) if costs else None
            undone[record["name"]] = (
                "RevertCostlyPasses"
                if worst is None
                else f"it took the float outputs to SQNR {_db(worst)}; RevertCostlyPasses"
            )
        return undone

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
            lines.append(
                f"NPU position adjustments: {len(self.adjustments)}, "
                f"unfixable: {len(self.unfixable)}"
            )
            lines += [f"  range clipped: {c['message']}" for c in self.range_clips]
            lines += _position_cost_lines(self.position_costs)
            lines.append(f"Vitis AI ready: {self.ready}")
            # errors first, one line per op type (every node in the JSON report)
            lines += [f"  {line}" for line in group_lines(self.check.get("findings", []))]
        else:
            lines.append("Vitis AI (XINT8) check: not applicable to float-scale settings")
        lines += self._fidelity_lines()
        lines += _mixed_precision_lines(self.mixed_precision)
        lines += [f"note: {note}" for note in self.notes]
        lines.append("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()))
        peak = self.process_peak_rss_mb
        if peak is not None:
            first = next(k for k, v in self.peak_rss_mb.items() if v == peak)
            lines.append(
                f"peak memory: {peak:.0f} MiB (process high-water mark, reached by the end of "
                f"stage {first!r}; per stage in the JSON report)"
            )
        return "\n".join(lines)

    def _fidelity_lines(self) -> list[str]:
        """The fidelity verdict and one line per output part (none when the guard did not run).

        Each part's line starts with the one number it is judged by (:func:`part_number`, the
        number the CLI's summary table shows), then the other measurements in brackets."""
        fid = self.fidelity
        if not fid:
            return []
        if fid.get("faithful") is None:
            return [f"faithful to the float model: not measured ({fid.get('error', '')})"]
        verdict = "yes" if fid["faithful"] else "NO"
        lines = [f"faithful to the float model: {verdict} ({fidelity_samples(fid)})"]
        lines += [f"  {_part_line(part)}" for part in fidelity_parts(fid)]
        for entry in self.repairs:
            outputs = ", ".join(f"{o['name']} SQNR {_db(o['sqnr_db'])}" for o in entry["outputs"])
            lines.append(
                f"  {'refinement' if entry.get('refinement') else 'repair'} tried: "
                f"{entry['repair']}: {outputs}" + (" (kept)" if entry.get("kept") else "")
            )
        for layer in fid.get("worst_layers", []):
            lines.append(
                f"  loses most: {layer['node'] or layer['tensor']} ({layer['op_type']}), "
                f"{layer['drop_db']:+.1f} dB"
            )
        return lines


#: The name of the one number each part measure (``PartFidelity.measure``) is judged by.
MEASURE_NAMES = {"top1": "top-1", "argmax": "pixels", "decisions": "F1", "sqnr": "SQNR"}


def significant(value: Any, digits: int = 3) -> str:
    """``value`` rounded to ``digits`` significant digits for people (``28.2``, ``0.918``,
    ``1.00``, ``1234``); ``inf``/``nan`` (also their JSON strings) as such."""
    number = float(value)
    if not math.isfinite(number):
        return str(number)
    if abs(number) >= 10**digits:
        return f"{number:.0f}"
    return f"{number:#.{digits}g}".rstrip(".")


def fidelity_parts(fidelity: dict[str, Any]) -> list[dict[str, Any]]:
    """Every output part of a verdict (``report.fidelity``), in output order; an output judged
    whole (no anatomy) is one part named like the output."""
    parts: list[dict[str, Any]] = []
    for out in fidelity.get("outputs", []):
        if out.get("parts"):
            parts += out["parts"]
            continue
        agreement = out.get("top1_agreement")
        parts.append(
            {
                "part": out["name"],
                "kind": "output",
                "measure": "sqnr" if agreement is None else "top1",
                "sqnr_db": out["sqnr_db"],
                "agreement": agreement,
                "decisions": 0,
                "kept": None,
                "faithful": out["faithful"],
            }
        )
    return parts


def part_number(part: dict[str, Any]) -> str:
    """The one number a part is judged by, rounded: ``top-1 1.00``, ``pixels 0.918``, ``F1
    0.953`` or ``SQNR 28.2 dB`` (a part with no agreement is judged by its SQNR)."""
    if part["measure"] == "sqnr" or part.get("agreement") is None:
        return f"SQNR {significant(part['sqnr_db'])} dB"
    name = MEASURE_NAMES.get(part["measure"], part["measure"])
    return f"{name} {significant(part['agreement'])}"


def fidelity_samples(fidelity: dict[str, Any]) -> str:
    """``16 held-out sample(s)`` or ``8 calibration sample(s)``: what a verdict was measured on."""
    which = "held-out" if fidelity.get("held_out") else "calibration"
    return f"{fidelity.get('samples', 0)} {which} sample(s)"


def _part_line(part: dict[str, Any]) -> str:
    """One output part's fidelity (:meth:`quark_onnx.fidelity.verdict.PartFidelity.to_dict`):
    the number it is judged by, then the other measurements in brackets."""
    details = []
    if part["measure"] == "decisions" and part.get("kept") is not None:
        details.append(
            f"{significant(100.0 * part['kept'])} % of {part['decisions']} float decisions kept"
        )
    if part["measure"] != "sqnr" and part.get("agreement") is not None:
        details.append(f"SQNR {_db(part['sqnr_db'])}")
    extra = f" [{', '.join(details)}]" if details else ""
    below = "" if part["faithful"] else "  <- below threshold"
    return f"{part['part']} ({part['kind']}): {part_number(part)}{extra}{below}"


def _mixed_precision_lines(record: dict[str, Any], shown: int = 8) -> list[str]:
    """What the mixed-precision search or list promoted, and what it costs."""
    if not record:
        return []
    promoted = record.get("promoted", [])
    head = "mixed precision"
    if record.get("target"):
        head += f" (target {record['target']}: {'met' if record.get('met') else 'NOT met'})"
    lines = [
        f"{head}: {len(promoted)} of {record.get('activation_tensors', 0)} activation tensor(s) "
        f"promoted ({100.0 * record.get('fraction', 0.0):.1f} %) to {record.get('precision')}"
        + (
            f"; {record['islands']} CPU island(s), {record['transitions']} NPU/CPU transition(s)"
            if record.get("islands") is not None
            else ""
        )
    ]
    for entry in promoted[:shown]:
        share = entry.get("error_share")
        lines.append(
            f"  promoted {entry['tensor']}"
            + (f": {100.0 * share:.0f} % of the output error" if share is not None else "")
            + (f" (float nodes: {', '.join(entry['nodes'])})" if entry.get("nodes") else "")
        )
    if len(promoted) > shown:
        lines.append(f"  promoted: {len(promoted) - shown} more (report)")
    return lines


def _position_cost_lines(entries: list[dict[str, Any]], shown: int = 5) -> list[str]:
    """The forced position moves costing at least one bit (6 dB) of a tensor's own SQNR."""
    from quark_onnx.npu.costs import COST_WARN_DB, cost_message

    costly = [e for e in entries if e["cost_db"] >= COST_WARN_DB]
    lines = [f"  rule cost: {cost_message(e)}" for e in costly[:shown]]
    if len(costly) > shown:
        lines.append(f"  rule cost: {len(costly) - shown} more tensor(s) lose >= 6 dB (report)")
    return lines


def _db(value: Any) -> str:
    return f"{significant(value)} dB"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
