"""The summary table, report.txt and report.json show the same fidelity number per output part,
with the verdict's sample count: rounded to 3 significant digits for people, exact in JSON."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
from cli_helpers import run_cli, tiny_cnn
from onnx import helper

from quark_onnx.pipeline.report import MEASURE_NAMES, significant


def _two_output_model() -> onnx.ModelProto:
    """The tiny CNN with a second graph output: its scores ``y`` [1, 6] and the feature map
    ``r2`` [1, 6, 8, 8] (a score vector and a dense output: two parts, two measures)."""
    model = tiny_cnn(3)
    model.graph.output.append(
        helper.make_tensor_value_info("r2", onnx.TensorProto.FLOAT, [1, 6, 8, 8])
    )
    return model


def _summary_parts(stdout: str, model: str) -> tuple[str, dict[str, str]]:
    """The ``samples`` cell and the ``PART: NUMBER`` cells of one model's rows."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("model "))
    samples_at = lines[header].index("samples")
    parts_at = lines[header].index("fidelity per output part")
    row = next(i for i, line in enumerate(lines) if line.split() and line.split()[0] == model)
    samples = lines[row][samples_at:parts_at].strip()
    cells = [lines[row][parts_at:]]
    for line in lines[row + 1 :]:
        if not line.strip() or line[:parts_at].strip():
            break
        cells.append(line[parts_at:])
    return samples, dict(cell.strip().split(": ", 1) for cell in cells)


def _text_parts(text: str) -> tuple[str, dict[str, str]]:
    """report.txt: the verdict's sample count and each part's leading number."""
    head = re.search(r"^faithful to the float model: \w+ \((\d+) held-out sample", text, re.M)
    assert head, text
    parts = dict(re.findall(r"^  (\S+) \([^)]*\): ((?:\S+ )?\S+(?: dB)?)(?: \[|$)", text, re.M))
    return head.group(1), parts


def test_summary_report_txt_and_json_show_the_same_part_numbers(tmp_path):
    model = tmp_path / "two.onnx"
    onnx.save(_two_output_model(), model)
    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.random.default_rng(0).normal(0, 1, (20, 3, 8, 8)).astype(np.float32))
    out = tmp_path / "out"
    result = run_cli("quantize", model, "-o", out, "--calib", calib, cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    fidelity = json.loads((out / "two.report.json").read_text())["fidelity"]
    assert fidelity["held_out"] is True and fidelity["samples"] == 5  # a quarter of the 20 held out
    parts = [p for o in fidelity["outputs"] for p in o["parts"]]
    assert len(parts) >= 2 and {p["measure"] for p in parts} >= {"top1"}
    expected = {}
    for p in parts:  # exact in JSON; the people's number is derived from it here
        if p["measure"] == "sqnr" or p["agreement"] is None:
            expected[p["part"]] = f"SQNR {significant(p['sqnr_db'])} dB"
        else:
            expected[p["part"]] = f"{MEASURE_NAMES[p['measure']]} {significant(p['agreement'])}"
    assert all(isinstance(p["sqnr_db"], float) for p in parts)

    samples, in_summary = _summary_parts(result.stdout, "two")
    assert samples == "5 held-out"
    assert in_summary == expected

    count, in_text = _text_parts((out / "two.report.txt").read_text())
    assert count == "5"
    assert in_text == expected
    # no unrounded float anywhere in the text report's fidelity (issue: "23.653678347461152 dB")
    assert not re.search(r"\d\.\d{5,} dB", (out / "two.report.txt").read_text())
    # the old whole-first-output SQNR column is gone
    assert "output SQNR dB" not in result.stdout
