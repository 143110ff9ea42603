"""A small progress reporter: a live line on a terminal, plain log lines elsewhere.

:class:`Progress` counts work done (samples, nodes, ...), measures the rate and reports it:

* on a terminal (``stream.isatty()``), one line rewritten in place at most every
  ``refresh_interval`` seconds, finished with a newline by :meth:`close`;
* otherwise (a pipe, a CI log), an INFO record on the given logger at most every ``log_interval``
  seconds and one at the end, so logs stay short;
* ``enabled=False`` shows nothing; a ``callback(done, total, rate)`` is called on every update in
  every mode (for GUIs and tests).

:class:`StageLine` announces a stage of unknown length that runs longer than a few seconds (a
pass over a large image, bias correction's replays): nothing for a quick stage, otherwise one
line when it has run ``after`` seconds, one every ``log_interval`` seconds while it runs, and one
with its time when it ends, so a long run never shows one unchanging line.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

ProgressCallback = Callable[[int, "int | None", float], None]

_logger = logging.getLogger(__name__)


class Progress:
    """Count ``update(n)`` calls and report ``done/total`` and the rate (see module doc)."""

    def __init__(
        self,
        total: int | None = None,
        *,
        desc: str = "progress",
        unit: str = "samples",
        enabled: bool | None = None,
        stream: IO[str] | None = None,
        callback: ProgressCallback | None = None,
        logger: logging.Logger | None = None,
        refresh_interval: float = 0.2,
        log_interval: float = 10.0,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.callback = callback
        self.logger = logger or _logger
        self.refresh_interval = refresh_interval
        self.log_interval = log_interval
        self.done = 0
        self._start = time.perf_counter()
        self._last = -float("inf")
        self._closed = False
        self._drawn = False
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if enabled is False:
            self.mode = "off"
        else:
            self.mode = "tty" if is_tty else "log"

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    @property
    def rate(self) -> float:
        """Units per second since the start (0 before any time has passed)."""
        t = self.elapsed
        return self.done / t if t > 0 else 0.0

    def text(self) -> str:
        total = f"/{self.total}" if self.total else ""
        return f"{self.desc}: {self.done}{total} {self.unit}, {self.rate:.1f} {self.unit}/s"

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total, self.rate)
        now = time.perf_counter()
        if self.mode == "tty" and now - self._last >= self.refresh_interval:
            self._last = now
            self.stream.write("\r" + self.text() + "\x1b[K")
            self.stream.flush()
            self._drawn = True
        elif self.mode == "log" and now - self._last >= self.log_interval:
            if self._last != -float("inf"):
                self.logger.info("%s", self.text())
            self._last = now

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.mode == "tty":
            self.stream.write("\r" + self.text() + f" in {self.elapsed:.1f} s\x1b[K\n")
            self.stream.flush()
        elif self.mode == "log":
            self.logger.info("%s in %.1f s", self.text(), self.elapsed)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StageLine:
    """Context manager: lines on ``stream`` (a terminal) or INFO records (elsewhere) for a stage
    that runs over ``after`` seconds (module doc); ``enabled=False`` shows nothing."""

    def __init__(
        self,
        desc: str,
        *,
        enabled: bool | None = None,
        after: float = 3.0,
        log_interval: float = 30.0,
        stream: IO[str] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.desc = desc
        self.after = after
        self.log_interval = log_interval
        self.stream = stream if stream is not None else sys.stderr
        self.logger = logger or _logger
        self.shown = 0  # lines written while the stage ran
        self._done = threading.Event()
        self._start = 0.0
        self._thread: threading.Thread | None = None
        if enabled is False:
            self.mode = "off"
        else:
            is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
            self.mode = "tty" if is_tty else "log"

    def _say(self, text: str) -> None:
        if self.mode == "tty":
            self.stream.write(text + "\n")
            self.stream.flush()
        else:
            self.logger.info("%s", text)

    def _watch(self) -> None:
        wait = self.after
        while not self._done.wait(wait):
            self._say(f"{self.desc}: running for {time.perf_counter() - self._start:.0f} s")
            self.shown += 1
            wait = self.log_interval

    def __enter__(self) -> StageLine:
        self._start = time.perf_counter()
        if self.mode != "off":
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is None:
            return
        self._thread.join()
        if self.shown:
            self._say(f"{self.desc}: done in {time.perf_counter() - self._start:.1f} s")
