"""The source tree imports as it is: ``quark_onnx.passes`` and ``quark_onnx.configs`` in a checkout.

The repository keeps the graph passes and the preset files at its top level (``passes/``,
``configs/``). A wheel installs them inside the package (pyproject's ``package-dir``), so that it
is self-contained and claims no generic top-level name. A checkout has them beside the package:
there ``quark_onnx/passes/__init__.py`` and ``quark_onnx/configs/__init__.py`` (not part of the
wheel) load the top-level folder under the package's name, so that
``python -c "import quark_onnx.passes"`` and Ray workers started in the repository root import the
tree as it is, without installing.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def load_top_level_folder(name: str, folder: str) -> None:
    """Make the package ``name`` the repository's top-level ``folder``: its ``__init__`` runs and
    its modules import as ``name.<module>`` (the import system returns the module placed in
    ``sys.modules``, not the stand-in that calls this)."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder)
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, "__init__.py"), submodule_search_locations=[root]
    )
    if spec is None or spec.loader is None:  # pragma: no cover - the folder is part of the tree
        raise ImportError(f"{name}: the repository's {folder}/ folder is missing", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
