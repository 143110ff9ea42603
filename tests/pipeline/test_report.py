"""The text report: numbers rounded for people, one line per output part, findings grouped, and
the passes a run undid known to the readiness advice."""

from __future__ import annotations

import pytest

from quark_onnx.pipeline.report import (
    QuantizationReport,
    fidelity_parts,
    part_number,
    significant,
)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (23.653678347461152, "23.7"),
        (0.91834, "0.918"),
        (1.0, "1.00"),
        (123.4, "123"),
        (99.96, "100"),
        (1234.5, "1234"),
        (-5.2, "-5.20"),
        (0.000123456, "0.000123"),
        (float("inf"), "inf"),
        ("-inf", "-inf"),  # JSON's spelling of infinities
        ("nan", "nan"),
    ],
)
def test_three_significant_digits(value, text):
    assert significant(value) == text


def _part(measure, agreement, sqnr=28.151382, **extra):
    return {
        "part": "y",
        "kind": "values",
        "measure": measure,
        "sqnr_db": sqnr,
        "agreement": agreement,
        "decisions": extra.get("decisions", 0),
        "kept": extra.get("kept"),
        "faithful": extra.get("faithful", True),
    }


def test_one_number_per_part_by_its_measure():
    assert part_number(_part("top1", 1.0)) == "top-1 1.00"
    assert part_number(_part("argmax", 0.9183)) == "pixels 0.918"
    assert part_number(_part("decisions", 0.7586, decisions=16, kept=0.6875)) == "F1 0.759"
    assert part_number(_part("sqnr", None)) == "SQNR 28.2 dB"
    assert part_number(_part("decisions", None)) == "SQNR 28.2 dB"  # no float decision


def _report() -> QuantizationReport:
    report = QuantizationReport(model="m.onnx")
    report.fidelity = {
        "faithful": False,
        "samples": 16,
        "held_out": True,
        "outputs": [
            {"name": "y", "sqnr_db": 9.0, "cosine": 0.9, "top1_agreement": None, "rows": 0,
             "faithful": False,
             "parts": [_part("sqnr", None, sqnr=21.6049),
                       _part("decisions", 0.7586, sqnr=6.7721, decisions=16, kept=0.6875,
                             faithful=False)]},
            # an output judged whole (no parts): one part named like the output
            {"name": "z", "sqnr_db": 30.0, "cosine": 0.99, "top1_agreement": 0.9375, "rows": 16,
             "faithful": True, "parts": []},
        ],
    }  # fmt: skip
    report.passes = [
        {"name": "ConvertSigmoidToHardSigmoid", "reverted": True,
         "fidelity": [{"name": "y", "sqnr_db": 14.4977}, {"name": "z", "sqnr_db": 31.2}]},
        {"name": "ConvertSplitToSlice", "reverted": False, "fidelity": []},
    ]  # fmt: skip
    return report


def test_the_text_report_shows_each_parts_number_and_the_sample_count():
    report = _report()
    lines = report.summary().splitlines()
    start = lines.index("faithful to the float model: NO (16 held-out sample(s))")
    assert lines[start + 1 : start + 4] == [
        "  y (values): SQNR 21.6 dB",
        "  y (values): F1 0.759 [68.8 % of 16 float decisions kept, SQNR 6.77 dB]  <- below "
        "threshold",
        "  z (output): top-1 0.938 [SQNR 30.0 dB]",
    ]
    assert [p["part"] for p in fidelity_parts(report.fidelity)] == ["y", "y", "z"]


def test_reverted_passes_with_what_they_cost():
    assert _report().reverted_passes == {
        "ConvertSigmoidToHardSigmoid": "it took the float outputs to SQNR 14.5 dB; "
        "RevertCostlyPasses"
    }
    assert QuantizationReport(model="m").reverted_passes == {}


def test_findings_one_line_per_op_type_in_the_text_report():
    report = QuantizationReport(model="m.onnx")
    report.check = {
        "ready": True,
        "findings": [
            {"rule": "unsupported_op", "severity": "warning", "node": f"s{i}",
             "message": f"Sigmoid node 's{i}': d", "op_type": "Sigmoid", "detail": "d"}
            for i in range(5)
        ],
    }  # fmt: skip
    lines = [line for line in report.summary().splitlines() if "unsupported_op" in line]
    assert lines == ["  warning unsupported_op: 5 Sigmoid nodes ('s0', 's1', 's2' and 2 more): d"]
