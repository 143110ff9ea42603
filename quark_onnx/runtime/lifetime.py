"""Child processes that end with their parent.

A worker of ``--jobs`` or a calibration shard is a spawned process; if the parent is killed with
``SIGKILL`` (no handler runs, nothing stops the pool) the workers would keep running, calibrating
for nobody. :func:`die_with_parent` makes a child ask the kernel for ``SIGTERM`` when its parent
ends (Linux ``PR_SET_PDEATHSIG``; the ``SIGTERM`` unwinds the job, so its temporary files go
too) and, where that is not available, watches the parent from a daemon thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

#: ``prctl`` option: the signal delivered to this process when its parent ends.
_PR_SET_PDEATHSIG = 1
#: Seconds between two looks at the parent where the kernel cannot be asked.
WATCH_INTERVAL_SECONDS = 1.0


def _ask_kernel() -> bool:
    """``prctl(PR_SET_PDEATHSIG, SIGTERM)``; False where it does not exist."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)


def die_with_parent(parent: int) -> None:
    """Call first thing in a child: it receives ``SIGTERM`` when process ``parent`` ends.

    ``parent`` is the id the parent had when it started the child: if it already ended before
    this call (the child was adopted meanwhile), the child ends at once.
    """
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _ask_kernel():
        # the parent may have ended between the check above and the request
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
        return
    with contextlib.suppress(RuntimeError):
        threading.Thread(target=_watch, args=(parent,), daemon=True, name="parent-watch").start()
