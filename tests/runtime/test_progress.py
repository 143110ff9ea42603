"""StageLine: silent for a quick stage, announced and timed for a long one."""

from __future__ import annotations

import io
import logging
import threading

from quark_onnx.runtime.progress import StageLine


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_quick_stage_shows_nothing():
    stream = _Terminal()
    with StageLine("prepare", after=3600.0, stream=stream) as line:
        pass
    assert stream.getvalue() == "" and line.shown == 0


def test_a_long_stage_is_announced_then_timed_on_a_terminal():
    stream = _Terminal()
    with StageLine("bias correction", after=0.0, log_interval=3600.0, stream=stream) as line:
        while line.shown == 0:  # the watcher's first line, written at once (after=0)
            threading.Event().wait(0.001)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("bias correction: running for ")
    assert lines[1].startswith("bias correction: done in ") and lines[1].endswith(" s")


def test_elsewhere_log_records_and_off_shows_nothing(caplog):
    caplog.set_level(logging.INFO, logger="quark_onnx.runtime.progress")
    with StageLine("calibrate", after=0.0, log_interval=3600.0, stream=io.StringIO()) as line:
        while line.shown == 0:
            threading.Event().wait(0.001)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["calibrate", "calibrate"]
    stream = _Terminal()
    with StageLine("calibrate", enabled=False, after=0.0, stream=stream) as line:
        threading.Event().wait(0.01)
    assert stream.getvalue() == "" and line.shown == 0
