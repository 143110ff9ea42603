"""Readiness findings: one line per op type with a count (every node in the JSON report), and no
advice to apply a pass the run measured and undid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from detectors.yolov8_like import build_yolov8_like, synthetic_images

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.npu.findings import SHOWN_NODES, group_findings
from quark_onnx.npu.readiness import check

REPO = Path(__file__).resolve().parents[2]
#: The advice the Sigmoid row gives when nothing is known of the run (quark_onnx.npu.ops).
ADVICE = "ConvertSigmoidToHardSigmoid replaces it"


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> tuple[Path, ModelQuantizer, Path]:
    """A tiny YOLO-style detector (57 SiLU Sigmoids) quantized to XINT8: the Sigmoid ->
    HardSigmoid rewrite costs it 14.5 dB and the run undoes it."""
    folder = tmp_path_factory.mktemp("detector")
    model = folder / "det.onnx"
    onnx.save(build_yolov8_like(size=64, num_classes=4, width=4), model)
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
    images = synthetic_images(24, 64, 1)
    quantizer.quantize_model(model, folder / "det.q.onnx", ArrayDataReader({"images": images}))
    return model, quantizer, folder / "det.q.onnx"


@pytest.mark.slow
def test_the_run_reverts_the_rewrite_and_the_report_does_not_advise_it(detector):
    model, quantizer, _ = detector
    report = quantizer.report
    assert list(report.reverted_passes) == ["ConvertSigmoidToHardSigmoid"]
    sigmoids = sum(n.op_type == "Sigmoid" for n in onnx.load(model).graph.node)
    findings = [f for f in report.check["findings"] if f["rule"] == "unsupported_op"]
    on_cpu = [f["node"] for f in findings if f["op_type"] == "Sigmoid"]
    assert 40 < len(on_cpu) <= sigmoids  # the decode tail's Sigmoid is the CPU partition's

    text = report.summary()
    lines = [line for line in text.splitlines() if "unsupported_op" in line]
    op_types = {f["op_type"] for f in findings}
    assert len(lines) == len(op_types)  # one line per op type
    (line,) = [line for line in lines if "Sigmoid nodes" in line]
    more = len(on_cpu) - SHOWN_NODES
    assert f"warning unsupported_op: {len(on_cpu)} Sigmoid nodes (" in line
    assert f"{on_cpu[0]!r}" in line and f" and {more} more)" in line
    assert on_cpu[-1] not in line  # the names past the first few are in the JSON report only
    (group,) = [g for g in report.check["groups"] if g["op_type"] == "Sigmoid"]
    assert group["nodes"] == on_cpu and group["count"] == len(on_cpu)
    # consistent with the run: no advice to apply the pass it measured and undid
    assert ADVICE not in text
    assert "ConvertSigmoidToHardSigmoid was measured on this model and undone" in line


@pytest.mark.slow
def test_without_the_run_the_check_still_advises_the_rewrite(detector):
    _, quantizer, written = detector
    plain = check(written)  # must-not-fire: nothing says the pass was tried
    assert ADVICE in plain.summary()
    told = check(written, reverted_passes=quantizer.report.reverted_passes)
    assert ADVICE not in told.summary()
    assert [f.node for f in plain.findings] == [f.node for f in told.findings]


def test_different_findings_stay_on_their_own_lines():
    findings = [
        {"rule": "shift_cut", "severity": "error", "node": "a", "message": "m1"},
        {"rule": "shift_cut", "severity": "error", "node": "b", "message": "m2"},
        {"rule": "unsupported_op", "severity": "warning", "node": "s1", "message": "x",
         "op_type": "Sigmoid", "detail": "d"},
        {"rule": "unsupported_op", "severity": "warning", "node": "p", "message": "y",
         "op_type": "Split", "detail": "e"},
        {"rule": "unsupported_op", "severity": "warning", "node": "s2", "message": "z",
         "op_type": "Sigmoid", "detail": "d"},
    ]  # fmt: skip
    groups = group_findings(findings)
    assert [g["message"] for g in groups] == [
        "m1",
        "m2",
        "2 Sigmoid nodes ('s1', 's2'): d",
        "y",
    ]
    assert [g["nodes"] for g in groups] == [["a"], ["b"], ["s1", "s2"], ["p"]]


@pytest.mark.slow
def test_the_digits_example_does_not_contradict_its_run(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quantize_digits.py"), "--out",
         str(tmp_path / "d.onnx")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # the run measures the rewrite and undoes it (stderr), and readiness does not propose it
    assert "ConvertSigmoidToHardSigmoid changed the float outputs" in result.stderr
    assert ADVICE not in result.stdout
    readiness = result.stdout[result.stdout.index("Vitis AI readiness:") :].splitlines()
    assert readiness[0] == "Vitis AI readiness: Vitis AI ready, 2 warning(s)"
    assert len(readiness) == 2 and readiness[1].startswith(
        "  warning unsupported_op: 2 Sigmoid nodes ('/b3/se/Sigmoid', '/b4/se/Sigmoid'): "
    )
