"""The graph passes: in a checkout, the repository's top-level ``passes/`` folder (see
:mod:`quark_onnx._checkout`); a wheel installs that folder here instead of this file."""

from quark_onnx._checkout import load_top_level_folder

load_top_level_folder(__name__, "passes")
