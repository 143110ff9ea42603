"""Model files: :mod:`.load` (read and validate), :mod:`.external` (external data),
:mod:`.paths` (the output guard), :mod:`.files` (atomic writes, bounded reads, interrupts) and
:mod:`.save` (write models). ``quark_onnx.model_files`` re-exports what callers use."""

from quark_onnx.model_files import external, files, load, paths, save

__all__ = ["external", "files", "load", "paths", "save"]
