"""Counters of the expensive things a quantization does (sessions built, full-model
serialisations), read by tests that hold the pipeline to a budget. Kept apart from
:mod:`quark_onnx.runtime.sessions` so that model loading and saving can count without importing
it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Counts:
    """What this process built so far (reset with :meth:`reset`)."""

    #: onnxruntime sessions created by :func:`create_session`.
    sessions: int = 0
    #: full-model serialisations: IR -> proto (``model_io.to_proto``) and proto -> bytes
    #: (:func:`serialize`, ``model_io.save_model``).
    serialisations: int = 0
    #: the place of each session, in order (the caller's ``purpose``).
    purposes: list[str] = dataclasses.field(default_factory=list)

    def reset(self) -> None:
        self.sessions = 0
        self.serialisations = 0
        self.purposes.clear()


COUNTS = Counts()
