"""quark_onnx.cli.batch.stop_resource_tracker: no semaphore left for the stopped tracker."""

from __future__ import annotations

import gc
import multiprocessing

from quark_onnx.cli.batch import stop_resource_tracker


def test_a_live_semaphore_is_unlinked_before_the_tracker_stops(capfd):
    """A semaphore still referenced when the tracker stops (as a frame of an interrupted batch
    can hold the pool's queues) must not leave its cleanup to run after the stop: the stopped
    tracker would unlink it first, and the cleanup at exit would print a traceback."""
    lock = multiprocessing.get_context("spawn").Lock()
    stop_resource_tracker()
    del lock
    gc.collect()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err and "leaked" not in err


LATE_SEMAPHORE = """
import multiprocessing, os
from multiprocessing import resource_tracker
from quark_onnx.cli.batch import stop_resource_tracker

stop_resource_tracker()
late = multiprocessing.get_context("spawn").Lock()  # registered with a new tracker
r, w = os.pipe()
os.close(r)
os.close(w)
resource_tracker._resource_tracker._fd = w  # the pipe closed under it, as seen once at exit
"""


def test_a_semaphore_cleanup_left_for_exit_prints_no_traceback(tmp_path):
    """A semaphore whose cleanup still runs at exit, when the tracker's pipe is gone: the cleanup
    registered by stop_resource_tracker runs it first, quietly (the unlink still happens)."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(LATE_SEMAPHORE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
