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
