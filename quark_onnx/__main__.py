"""``python -m quark_onnx`` runs the command-line interface."""

from quark_onnx.cli import main

raise SystemExit(main())
