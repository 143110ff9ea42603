"""The ``quark-onnx`` command line (also ``python -m quark_onnx``).

Subcommands:

``quantize MODEL_OR_FOLDER... -o OUT_DIR`` / ``quantize --manifest MODELS.toml -o OUT_DIR``
    Quantize one or many models with a preset (``--config``, default XINT8) plus ``--set
    KEY=VALUE`` overrides; a manifest gives each model its own calibration data,
    pre-processing, preset and options (:mod:`~quark_onnx.cli.manifest`). For each model
    ``NAME.onnx`` it writes ``OUT_DIR/NAME.onnx``, the JSON
    report ``OUT_DIR/NAME.report.json`` (:meth:`QuantizationReport.save`), a readable summary
    ``OUT_DIR/NAME.report.txt`` and, when data allows a float-vs-quantized comparison,
    ``OUT_DIR/NAME.compare.json`` (:func:`quark_onnx.fidelity.compare.compare_models` on the first
    ``--compare-samples`` calibration samples). A failing model prints one line ``error: MODEL:
    MESSAGE`` (the traceback only with ``--debug``) and the others go on; a summary table ends the
    run; the exit code is 1 when any model failed. ``--jobs N`` quantizes N models at once in
    processes started with the ``spawn`` method (onnxruntime and ``fork`` do not mix); each model
    is quantized by the same code with the same settings whatever N is, so outputs are identical.
``check MODEL...``
    The Vitis AI readiness check (:func:`quark_onnx.npu.readiness.check`); exit code 1 when a model
    is not ready (or cannot be read).
``compare FLOAT QUANTIZED``
    Float vs quantized on data: per-output SQNR / cosine / top-1 agreement and per-layer SQNR of
    the quantized tensors, worst first.
``export MODEL --format recipe|gguf|onnx -o OUT``
    Write a quantized (QDQ) model in another format: ``recipe`` (a folder: the configuration as
    JSON and every tensor's scale, zero point and codes in safetensors,
    :func:`quark_onnx.formats.recipe. save_recipe`; needs ``--float-model`` and the settings it was
    quantized with, from ``--report MODEL.report.json`` or ``--config``/``--set``), ``gguf``
    (weight-only tensors, :func:`quark_onnx.formats.gguf_export.export_gguf`; needs the optional
    ``gguf`` package) or ``onnx`` (the QDQ model itself, validated and re-written).
``import SOURCE -o OUT``
    ``SOURCE`` a QDQ model (this project's, onnxruntime's or Quark's standard QDQ): write the
    recipe folder ``OUT`` (with the float model, :func:`quark_onnx.formats.recipe.import_recipe`).
    ``SOURCE`` a recipe folder: rebuild the quantized model ``OUT`` (``.onnx``) without
    calibration (:func:`quark_onnx.formats.recipe.load_recipe`; ``--float-model`` unless the recipe
    was imported).
``presets`` / ``options``
    The presets and their settings; every extra option with its type, default and meaning.

Exit codes: 0 success (``quantize`` writes and reports a model that is not Vitis AI-ready and
exits 0 unless ``--require-ready``); 1 a model failed (with ``--require-fidelity`` also a model
whose outputs do not follow the float model's: it is not written), is not ready (``check``,
``quantize --require-ready``), or a comparison failed;
2 a usage or configuration error (unknown preset or option, bad flag value), reported as one line
naming the closest valid name.

Values of ``--set KEY=VALUE`` are read as JSON literals (``true``, ``3``, ``0.5``, ``[1, 2]``,
``{"a": [0, 1]}``), ``True``/``False``/``None`` as in Python, and anything else as a string.

The package: :mod:`~quark_onnx.cli.main` (parser and :func:`main`), one module per command with
its parser (``quantize``, ``check``, ``compare``, ``export``, ``import_``, ``presets``,
``options``), and the shared parts: :mod:`~quark_onnx.cli.manifest` (a batch's per-model
settings), :mod:`~quark_onnx.cli.consistency` (does one calibration source fit every model),
:mod:`~quark_onnx.cli.settings` (preset + ``--set`` ->
QuantizationConfig), :mod:`~quark_onnx.cli.calibration` (calibration data of one model),
:mod:`~quark_onnx.cli.jobs` (one model) and :mod:`~quark_onnx.cli.batch` (the batch runner).
"""

from __future__ import annotations

from quark_onnx.cli.batch import (
    BatchInterrupted,
    Console,
    collect_models,
    output_names,
    run_batch,
    summary_table,
)
from quark_onnx.cli.calibration import calibration_reader, comparison_feeds, npz_reader
from quark_onnx.cli.common import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from quark_onnx.cli.jobs import Job, Outcome, error_message, failed_outcome, quantize_one
from quark_onnx.cli.main import build_parser, main
from quark_onnx.cli.settings import (
    QuantizeSettings,
    apply_assignments,
    parse_assignments,
    parse_value,
)

__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "BatchInterrupted",
    "Console",
    "Job",
    "Outcome",
    "QuantizeSettings",
    "apply_assignments",
    "build_parser",
    "calibration_reader",
    "collect_models",
    "comparison_feeds",
    "error_message",
    "failed_outcome",
    "main",
    "npz_reader",
    "output_names",
    "parse_assignments",
    "parse_value",
    "quantize_one",
    "run_batch",
    "summary_table",
]
