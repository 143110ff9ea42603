"""``quark-onnx quantize --ray`` and :func:`quark_onnx.cli.ray_runner.quantize_batch_on_ray` on a
local Ray cluster of 2 CPUs (started once for the module, stopped after): the same outputs, reports
and summary as the process runner, one ``error:`` line per failed model, sharded calibration as
Ray tasks, Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import run_cli, tiny_cnn
from conftest import shared_path

ray = pytest.importorskip(
    "ray", reason="the optional ray extra is not installed (pip install -e '.[test,ray]')"
)

from quark_onnx import cli  # noqa: E402
from quark_onnx.cli.ray_runner import quantize_batch_on_ray  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> str:
    """A local Ray cluster of 2 CPUs for this module; its address (for ``--ray ADDRESS``).

    ``ray.init`` leaves a ``SIGTERM`` handler of its own in this process: restored after, so the
    tests that follow see the default one."""
    sigterm = signal.getsignal(signal.SIGTERM)
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        signal.signal(signal.SIGTERM, sigterm)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Three tiny models, a corrupt one, calibration data."""
    root = tmp_path_factory.mktemp("ray")
    models = root / "models"
    models.mkdir()
    for i in range(3):
        onnx.save(tiny_cnn(i), models / f"tiny{i}.onnx")
    (models / "broken.onnx").write_bytes(b"\x08\x07 this is not a protobuf " * 20)
    x = np.random.default_rng(5).uniform(0, 1, (12, 3, 8, 8)).astype(np.float32)
    np.savez(root / "calib.npz", x=x)  # 12 samples of shape [3, 8, 8] on axis 0
    return root


#: What a report measures rather than computes (and the output path, another folder here).
_MEASURED = {"timings", "total_seconds", "seconds", "peak_rss_mb", "process_peak_rss_mb", "output"}


def _report(path: Path) -> dict:
    """A report without its measurements."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _MEASURED}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(json.loads(path.read_text()))


def _without_times(text: str) -> str:
    measured = ("timings:", "peak memory:")
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith(measured))


def _table(outcomes) -> str:
    """The summary table with the seconds column blanked (the one thing allowed to differ)."""
    for o in outcomes:
        o.seconds = 0.0
    return cli.summary_table(outcomes)


def test_ray_batch_gives_the_outputs_reports_and_summary_of_one_process(cluster, work, tmp_path):
    settings = cli.QuantizeSettings(calib=str(work / "calib.npz"), compare_samples=4)
    models = cli.collect_models([str(work / "models")])
    names = cli.output_names(models)
    one = tmp_path / "one"
    one.mkdir()
    jobs = [
        cli.Job(index=i, model=str(m), name=n, out_dir=str(one), settings=settings)
        for i, (m, n) in enumerate(zip(models, names, strict=True))
    ]
    # the reference runs in fresh processes too (--jobs 2): the text of a protobuf parse error
    # depends on what the process imported before, not on the runner
    reference = cli.run_batch(jobs, 2, cli.Console(len(jobs), io.StringIO()), False)

    # the same batch as Ray tasks, each calibrated in 2 shards run as Ray tasks too
    sharded = cli.QuantizeSettings(
        calib=str(work / "calib.npz"), compare_samples=4, calib_shards=2, shard_backend="ray"
    )
    stream = io.StringIO()
    outcomes = quantize_batch_on_ray([work / "models"], tmp_path / "ray", sharded, stream=stream)
    assert [o.name for o in outcomes] == ["broken", "tiny0", "tiny1", "tiny2"]
    errors = [line for line in stream.getvalue().splitlines() if line.startswith("error:")]
    assert errors == [f"error: {work / 'models' / 'broken.onnx'}: {reference[0].message}"]
    assert "not a valid ONNX model" in errors[0]
    assert _table(outcomes) == _table(reference)
    assert [o.ok for o in outcomes] == [False, True, True, True]
    for name in ("tiny0", "tiny1", "tiny2"):
        a, b = one / name, tmp_path / "ray" / name
        assert a.with_suffix(".onnx").read_bytes() == b.with_suffix(".onnx").read_bytes(), name
        assert _report(Path(f"{a}.report.json")) == _report(Path(f"{b}.report.json"))
        assert Path(f"{a}.compare.json").read_text() == Path(f"{b}.compare.json").read_text()
        txt_a = Path(f"{a}.report.txt").read_text().replace(str(one), "OUT")
        txt_b = Path(f"{b}.report.txt").read_text().replace(str(tmp_path / "ray"), "OUT")
        assert _without_times(txt_a) == _without_times(txt_b)
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == sorted(
        p.name for p in one.iterdir()
    )
    # the models differ: equal outputs are not trivially equal
    assert (one / "tiny0.onnx").read_bytes() != (one / "tiny1.onnx").read_bytes()


def test_cli_ray_flag_on_the_cluster_address(cluster, work, tmp_path):
    """The console script connects to a running cluster by address, from the user's folder
    (relative paths), and reports a failed model as one line."""
    result = run_cli(
        "quantize", Path("models"), "-o", tmp_path / "out", "--calib", "calib.npz",
        "--ray", cluster, "--calib-shards", "2", cwd=work,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: models/broken.onnx: ")
    assert "quantizing 4 models as Ray tasks (2 CPUs in the cluster, 1 per task)" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.onnx")) == [
        "tiny0.onnx",
        "tiny1.onnx",
        "tiny2.onnx",
    ]
    report = json.loads((tmp_path / "out" / "tiny1.report.json").read_text())
    # 3 of the 12 samples held out for the verdict
    assert report["model"] == "models/tiny1.onnx" and report["calibration"]["samples"] == 9
    assert "3 of 4 models quantized, 1 failed" in result.stdout
    # a captured stream is not a terminal: Ray's colour codes around worker lines are dropped
    assert "(_quantize_task pid=" in result.stderr and "\x1b[" not in result.stderr


@pytest.mark.parametrize(
    ("sig", "code", "message"),
    [(signal.SIGINT, 130, "error: interrupted"), (signal.SIGTERM, 143, "error: terminated")],
)
def test_ctrl_c_cancels_the_remaining_tasks(cluster, work, tmp_path, sig, code, message):
    """Ctrl-C (or SIGTERM) during a batch: exit 130 (143), the tasks not started never run, the
    running ones are interrupted (each would calibrate for about a minute), nothing partial is
    left."""
    models = tmp_path / "models"
    models.mkdir()
    for i in range(6):
        onnx.save(tiny_cnn(i), models / f"m{i}.onnx")
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "quark_onnx", "quantize", str(models), "-o", str(out),
         "--random-calib", "100000", "--compare-samples", "0", "--ray", cluster],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
        # a Ctrl-C handler even when the tests run where SIGINT is ignored (a background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines = []
    for line in proc.stderr:  # wait until the tasks are submitted
        lines.append(line)
        if "as Ray tasks" in line:
            break
    time.sleep(1.0)  # let the first two tasks start
    proc.send_signal(sig)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == code, "".join(lines) + rest
    assert message in rest
    assert list(out.iterdir()) == []  # no output, no temporary file
    # the interrupted tasks have ended (they would hold both CPUs for a minute otherwise)
    for _ in range(20):
        if ray.available_resources().get("CPU", 0) == 2:
            break
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == 2


@pytest.mark.real_model
@pytest.mark.slow
def test_shared_models_through_ray_equal_jobs_1(cluster, tmp_path):
    digits = shared_path("models", "digits_cnn.onnx")
    squeezenet = shared_path("models", "squeezenet1.1.onnx")
    corrupt = tmp_path / "truncated.onnx"
    corrupt.write_bytes(squeezenet.read_bytes()[:5000])
    runs = {}
    for flag in (("--jobs", "1"), ("--ray", cluster)):
        out = tmp_path / flag[0].strip("-")
        result = run_cli(
            "quantize", digits, squeezenet, corrupt, "-o", out, "--random-calib", "8",
            *flag, cwd=tmp_path, timeout=1200,
        )  # fmt: skip
        assert result.returncode == 1, result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {corrupt}: ")
        table = [_blank_seconds(line) for line in result.stdout.splitlines()]
        runs[flag[0]] = (out, errors, table)
    (one, errors1, table1), (out, errors2, table2) = runs["--jobs"], runs["--ray"]
    assert errors1 == errors2 and table1 == table2
    for name in ("digits_cnn", "squeezenet1.1"):
        assert (one / f"{name}.onnx").read_bytes() == (out / f"{name}.onnx").read_bytes()
        assert _report(one / f"{name}.report.json") == _report(out / f"{name}.report.json")
        assert (one / f"{name}.compare.json").read_bytes() == (
            out / f"{name}.compare.json"
        ).read_bytes()
    assert os.listdir(one) and sorted(os.listdir(one)) == sorted(os.listdir(out))


def _blank_seconds(line: str) -> str:
    """A summary table row with its seconds cell blanked."""
    cells = re.split(r"\s{2,}", line.strip())
    if len(cells) >= 3 and cells[1] in ("ok", "failed"):
        cells[2] = "-"
    return "  ".join(cells)


def test_an_address_nothing_answers_at_is_a_usage_error(work, tmp_path):
    result = run_cli(
        "quantize", work / "models" / "tiny0.onnx", "-o", tmp_path / "out", "--random-calib", "2",
        "--ray", "127.0.0.1:1", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "error: --ray 127.0.0.1:1: nothing answers there"
    )
    assert not list((tmp_path / "out").glob("*.onnx"))
