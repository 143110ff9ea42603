"""One self-contained HTML page per quantization, and one per batch (``quantize --report-html``).

The page is built from the JSON report (:meth:`QuantizationReport.to_dict`) and, when the CLI
compared the models, the comparison (``NAME.compare.json``): the per-output fidelity table (with
each output's ``parts`` when the report has them), the per-layer error chart (worst layers first),
the NPU/CPU partition, the numerics-changing passes and their cost, and time and peak memory per
stage. Charts are inline SVG and the style is inline CSS: no script, no external resource, no
dependency beyond the standard library, so the file opens anywhere and can be attached as it is.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: at most this many layers in the per-layer chart (the worst ones)
MAX_LAYERS = 40

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#1b1f24}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ccd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f0f2f5}td.num{text-align:right;
font-variant-numeric:tabular-nums}tr.part td:first-child{padding-left:24px}
.yes{color:#176f2c;font-weight:600}.no{color:#b3261e;font-weight:600}.muted{color:#667}
.verdicts span{display:inline-block;margin-right:16px;padding:4px 10px;border-radius:4px;
background:#f0f2f5}svg text{font:12px system-ui,sans-serif}
"""

_GOOD, _FAIR, _BAD, _CPU, _NPU = "#2e8b57", "#d99a00", "#c0392b", "#8d99ae", "#3a6ea5"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any, digits: int = 2) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.{digits}f}"
    return str(value)


def _verdict(value: Any) -> str:
    if value is None:
        return '<span class="muted">-</span>'
    return '<span class="yes">yes</span>' if value else '<span class="no">NO</span>'


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], classes: Sequence[str] = ()
) -> str:
    """A table of already-escaped cells; ``classes`` gives each row's class (or "")."""
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = classes[i] if i < len(classes) and classes[i] else ""
        attr = f' class="{cls}"' if cls else ""
        body.append(f"<tr{attr}>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def bar_chart(
    items: Sequence[tuple[str, float, str]],
    unit: str,
    *,
    title: str,
    width: int = 900,
    digits: int = 2,
) -> str:
    """A horizontal bar chart as inline SVG: one ``(label, value, colour)`` per bar, negative
    values drawn left of the zero axis."""
    if not items:
        return ""
    finite = [v for _, v, _ in items if math.isfinite(v)]
    low, high = min([0.0, *finite]), max([0.0, *finite])
    span = (high - low) or 1.0
    label_w, value_w, bar_h, gap = 300, 80, 16, 4
    plot_w = width - label_w - value_w
    zero = label_w + plot_w * (0 - low) / span
    height = len(items) * (bar_h + gap) + 24
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{_e(title)}"><title>{_e(title)}</title>'
    ]
    for i, (label, value, colour) in enumerate(items):
        y = i * (bar_h + gap)
        shown = value if math.isfinite(value) else (high if value > 0 else low)
        x0, x1 = sorted((zero, label_w + plot_w * (shown - low) / span))
        text = label if len(label) <= 44 else "…" + label[-43:]
        shown_value = f"{_e(_num(value, digits))} {_e(unit)}"
        parts.append(
            f'<text x="{label_w - 6}" y="{y + bar_h - 4}" text-anchor="end">{_e(text)}</text>'
            f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" height="{bar_h}" '
            f'fill="{colour}"><title>{_e(label)}: {shown_value}</title></rect>'
            f'<text x="{width - value_w + 6}" y="{y + bar_h - 4}">{shown_value}</text>'
        )
    axis_y = len(items) * (bar_h + gap)
    parts.append(
        f'<line x1="{zero:.1f}" y1="0" x2="{zero:.1f}" y2="{axis_y}" stroke="#333"/>'
        f'<text x="{zero:.1f}" y="{axis_y + 16}" text-anchor="middle">0</text></svg>'
    )
    return "".join(parts)


def _sqnr_colour(sqnr: float, threshold: float) -> str:
    if not math.isfinite(sqnr) or sqnr >= 2 * threshold:
        return _GOOD
    return _FAIR if sqnr >= threshold else _BAD


def _fidelity(report: Mapping[str, Any]) -> str:
    fidelity = report.get("fidelity") or {}
    outputs = fidelity.get("outputs") or []
    if not outputs:
        return '<p class="muted">No fidelity measurement (FidelityCheck off or no data).</p>'
    base = ["name", "sqnr_db", "cosine", "top1_agreement", "argmax_agreement", "rows", "faithful"]
    keys = [k for k in base if any(k in o for o in outputs)]
    rows, classes = [], []
    for out in outputs:
        rows.append([_cell(out.get(k), k) for k in keys])
        classes.append("")
        for part in out.get("parts") or []:  # per-part entries, when the report has them
            extra = ", ".join(
                f"{_e(k)} {_e(_num(v, 3))}"
                for k, v in part.items()
                if k not in keys and k != "kind"
            )
            cells = [_cell(part.get(k), k) for k in keys]
            cells[0] = f"{_e(part.get('name', ''))} <span class='muted'>{_e(part.get('kind', ''))}"
            cells[0] += f" {extra}</span>" if extra else "</span>"
            rows.append(cells)
            classes.append("part")
    note = (
        f"<p>Against the original float model on {_e(fidelity.get('samples', '?'))} calibration "
        f"samples; faithful: top-1 agreement ≥ {_e(fidelity.get('min_agreement', '?'))} for a "
        f"score vector, SQNR ≥ {_e(fidelity.get('min_sqnr_db', '?'))} dB otherwise.</p>"
    )
    return note + _table(keys, rows, classes)


def _cell(value: Any, key: str) -> str:
    if key == "faithful":
        return _verdict(value)
    if key == "name":
        return _e(value)
    text = _e(_num(value, 2 if key == "sqnr_db" else 4))
    return f'<span class="num">{text}</span>'


def _layers(report: Mapping[str, Any], comparison: Mapping[str, Any] | None) -> str:
    """The per-layer chart: the report's layer error analysis, else the comparison's per-layer
    SQNR, else the layers the fidelity guard named; worst (lowest SQNR) first."""
    entries = [
        (str(e.get("node") or e.get("tensor")), float(e["sqnr_db"]))
        for e in report.get("layer_errors") or []
        if e.get("sqnr_db") is not None
    ]
    source = "layer error analysis (LayerErrorAnalysis)"
    if not entries and comparison:
        entries = [
            (str(e["name"]), float(e["sqnr_db"]))
            for e in comparison.get("layers") or []
            if e.get("sqnr_db") is not None
        ]
        source = "comparison of every quantized activation (--compare-layers)"
    if not entries:
        worst = (report.get("fidelity") or {}).get("worst_layers") or []
        entries = [
            (str(e.get("node") or e.get("tensor")), float(e["sqnr_db"]))
            for e in worst
            if e.get("sqnr_db") is not None
        ]
        source = "the layers the fidelity guard named"
    if not entries:
        return '<p class="muted">No per-layer measurement in this report.</p>'
    entries.sort(key=lambda e: e[1])
    threshold = float((report.get("fidelity") or {}).get("min_sqnr_db") or 10.0)
    items = [(n, v, _sqnr_colour(v, threshold)) for n, v in entries[:MAX_LAYERS]]
    shown = f"the {len(items)} worst of {len(entries)}" if len(entries) > len(items) else "all"
    return (
        f"<p>SQNR of each quantized tensor against the float model ({_e(source)}; {shown}, "
        "worst first).</p>" + bar_chart(items, "dB", title="per-layer SQNR, worst first")
    )


def _partition(report: Mapping[str, Any]) -> str:
    plan = report.get("plan") or {}
    float_nodes = report.get("float_nodes") or []
    quantized = plan.get("quantized_nodes")
    check = report.get("check") or {}
    findings = check.get("findings") or []
    cpu_rules = ("unsupported_op",)
    cpu = [f for f in findings if f.get("rule") in cpu_rules]
    parts = []
    if quantized is not None:
        parts.append(
            bar_chart(
                [
                    ("quantized nodes (NPU)", float(quantized), _NPU),
                    ("float nodes (CPU)", float(len(float_nodes)), _CPU),
                ],
                "nodes",
                title="NPU/CPU partition",
                width=700,
                digits=0,
            )
        )
    if float_nodes:
        rows = [[_e(n.get("node")), _e(n.get("op_type")), _e(n.get("reason"))] for n in float_nodes]
        parts.append("<h3>Float nodes</h3>" + _table(["node", "op type", "why"], rows))
    if cpu:
        rows = [[_e(f.get("node")), _e(f.get("message"))] for f in cpu]
        parts.append("<h3>CPU ops by the readiness check</h3>" + _table(["node", "finding"], rows))
    errors = [f for f in findings if f.get("severity") == "error"]
    if errors:
        rows = [[_e(f.get("rule")), _e(f.get("node")), _e(f.get("message"))] for f in errors]
        parts.append("<h3>Not ready because</h3>" + _table(["rule", "node", "finding"], rows))
    for key, title in (("position_costs", "Positions moved by an NPU rule"),
                       ("range_clips", "Ranges clipped by an NPU rule")):  # fmt: skip
        entries = report.get(key) or []
        if entries:
            keys = list(dict.fromkeys(k for e in entries for k in e))
            rows = [[_e(_num(e.get(k), 3)) for k in keys] for e in entries]
            parts.append(f"<h3>{_e(title)}</h3>" + _table(keys, rows))
    return "".join(parts) or '<p class="muted">No plan in this report.</p>'


def _passes(report: Mapping[str, Any]) -> str:
    passes = report.get("passes") or []
    if not passes:
        return '<p class="muted">No graph pass ran.</p>'
    rows = []
    for p in passes:
        worst = [f for f in p.get("fidelity") or [] if isinstance(f, Mapping)]
        sqnr = min((f["sqnr_db"] for f in worst if f.get("sqnr_db") is not None), default=None)
        state = "reverted" if p.get("reverted") else ("applied" if p.get("modified") else "-")
        rows.append(
            [
                _e(p.get("name")),
                _e(state),
                _e("yes" if p.get("changes_numerics") else "no"),
                f'<span class="num">{_e(_num(sqnr))}</span>',
                f'<span class="num">{_e(_num(1000 * float(p.get("seconds") or 0), 1))}</span>',
                _e(p.get("warning") or ""),
            ]
        )
    header = ["pass", "effect", "changes numerics", "output SQNR after (dB)", "ms", "warning"]
    return _table(header, rows)


def _stages(report: Mapping[str, Any]) -> str:
    timings = report.get("timings") or {}
    peaks = report.get("peak_rss_mb") or {}
    if not timings:
        return '<p class="muted">No stage timings.</p>'
    time_items = [(k, float(v), _NPU) for k, v in timings.items()]
    mem_items = [(k, float(v), _CPU) for k, v in peaks.items()]
    return (
        "<h3>Time per stage</h3>"
        + bar_chart(time_items, "s", title="time per stage")
        + "<h3>Peak resident memory after each stage (process high-water mark)</h3>"
        + bar_chart(mem_items, "MiB", title="peak memory per stage", digits=0)
    )


def render(
    report: Mapping[str, Any], comparison: Mapping[str, Any] | None = None, title: str = ""
) -> str:
    """The HTML page of one quantization: ``report`` is ``QuantizationReport.to_dict()``,
    ``comparison`` the CLI's ``compare.json`` (or None)."""
    name = title or str(report.get("output") or report.get("model") or "model")
    check = report.get("check") or {}
    fidelity = report.get("fidelity") or {}
    total = report.get("total_seconds")
    peak = report.get("process_peak_rss_mb")
    head = (
        f'<div class="verdicts"><span>Vitis AI ready: {_verdict(check.get("ready"))}</span>'
        f"<span>faithful: {_verdict(fidelity.get('faithful'))}</span>"
        f"<span>time: {_e(_num(total))} s</span><span>peak memory: {_e(_num(peak, 0))} MiB"
        "</span></div>"
    )
    notes = "".join(f"<li>{_e(n)}</li>" for n in report.get("notes") or [])
    repairs = report.get("repairs") or []
    repair_rows = [[_e(_num(r.get(k), 3)) for k in r] for r in repairs if isinstance(r, Mapping)]
    repair_html = (
        "<h2>Fidelity repair attempts</h2>" + _table(list(repairs[0]), repair_rows)
        if repair_rows
        else ""
    )
    sections = [
        f"<h1>{_e(name)}</h1>",
        f'<p class="muted">float model: {_e(report.get("model", ""))}</p>',
        head,
        "<h2>Fidelity per output</h2>",
        _fidelity(report),
        repair_html,
        "<h2>Per-layer error</h2>",
        _layers(report, comparison),
        "<h2>NPU/CPU partition</h2>",
        _partition(report),
        "<h2>Graph passes</h2>",
        _passes(report),
        "<h2>Time and memory per stage</h2>",
        _stages(report),
        f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "",
    ]
    return _page(name, "".join(sections))


def render_batch(rows: Sequence[Mapping[str, Any]], title: str = "quark_onnx batch") -> str:
    """The batch page: one row per model (``name``, ``ok``, ``seconds``, ``ready``, ``faithful``,
    ``sqnr_db``, ``message``, ``page``: the model page's file name or None)."""
    table_rows = []
    for r in rows:
        link = f'<a href="{_e(r["page"])}">{_e(r["name"])}</a>' if r.get("page") else _e(r["name"])
        table_rows.append(
            [
                link,
                _e("ok" if r.get("ok") else "failed"),
                f'<span class="num">{_e(_num(r.get("seconds"), 1))}</span>',
                _verdict(r.get("ready")),
                _verdict(r.get("faithful")),
                f'<span class="num">{_e(_num(r.get("sqnr_db")))}</span>',
                _e(r.get("message") or ""),
            ]
        )
    header = ["model", "status", "seconds", "Vitis AI ready", "faithful", "output SQNR dB", ""]
    sqnr = [
        (str(r["name"]), float(r["sqnr_db"]), _sqnr_colour(float(r["sqnr_db"]), 10.0))
        for r in rows
        if r.get("sqnr_db") is not None
    ]
    seconds = [(str(r["name"]), float(r.get("seconds") or 0), _NPU) for r in rows]
    body = (
        f"<h1>{_e(title)}</h1><h2>Models</h2>"
        + _table(header, table_rows)
        + "<h2>Output SQNR (first output)</h2>"
        + (bar_chart(sorted(sqnr, key=lambda i: i[1]), "dB", title="output SQNR") or "<p>-</p>")
        + "<h2>Time per model</h2>"
        + bar_chart(seconds, "s", title="time per model")
    )
    return _page(title, body)


def write_batch_page(out_dir: str | os.PathLike, outcomes: Sequence[Any]) -> Path:
    """Write ``OUT_DIR/index.html``, the batch's page, from the CLI's outcomes (objects with
    ``name``, ``ok``, ``seconds``, ``ready``, ``faithful``, ``output_sqnr_db``, ``message``),
    linking each written model's page."""
    from quark_onnx.model_files.files import atomic_write_bytes, text_bytes

    folder = Path(out_dir)
    rows = []
    for o in outcomes:
        page = f"{o.name}.report.html"
        rows.append(
            {
                "name": o.name,
                "ok": o.ok,
                "seconds": o.seconds,
                "ready": o.ready,
                "faithful": o.faithful,
                "sqnr_db": o.output_sqnr_db,
                "message": o.message,
                "page": page if o.ok and (folder / page).is_file() else None,
            }
        )
    path = folder / "index.html"
    atomic_write_bytes(path, text_bytes(render_batch(rows)))
    return path


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>{body}</body></html>\n"
    )
