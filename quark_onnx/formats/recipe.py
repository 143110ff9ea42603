"""Quantization recipes: save a quantized model's configuration and parameters, rebuild it later.

A recipe is a folder of two files (three for an imported model):

``recipe.json``
    The format name and version; the full configuration (every :class:`QuantizationConfig`
    field, enums by name, and every extra option with its default filled in) and the preset it
    started from, if any; the float model's identity (:func:`quark_onnx.calibration.result.
    model_hash`, SHA-256 of its structure and initializer values); the SHA-256 of the quantized
    model's bytes; the ordered list of quantized tensors with ``qtype``, ``shape``, ``axis``,
    ``block_size``, ``dynamic``, ``symmetric`` and the names of their arrays; and the SHA-256 of
    the parameter file.
``params.safetensors``
    Per tensor ``<name>.scale`` (float32), ``<name>.zero_point`` and, for constants,
    ``<name>.codes`` (the integer codes the quantized model holds, so AdaRound and bias
    correction are kept), read and written by :mod:`quark_onnx.formats.safetensors_io` (int4/uint4
    stored one code per byte, the true type in the metadata).
``float_model.onnx``
    Only for a recipe imported from a QDQ model (:func:`import_recipe`): the float model the
    parameters apply to (the QDQ patterns removed, dequantized weights folded to float).

Rebuilding (:func:`load_recipe`) runs no calibration and needs no data::

    float model -> quantize_passes(config)   (the prepare and DPU-simulation passes)
                -> InsertQDQ(params)          (codes written as they are, not re-quantized)
                -> finalize_passes(config)    -> quantized model

which is what :class:`~quark_onnx.pipeline.quantizer.ModelQuantizer` does around calibration, so the
result is byte-identical to the model the recipe was saved from (:func:`save_recipe` checks that
before writing anything). What a prepare pass chose from the calibration samples is recorded in
the configuration so that the rebuild needs none: the LayerNorm scales of
MigrateActivationOutliers (``MigrateActivationOutliersScales``, read from the quantized model's
node metadata). An imported recipe has no configuration: its float model is already
prepared, and the rebuild is ``InsertQDQ(params)`` alone.

Loading executes nothing from the files: JSON via :func:`json.loads` (duplicate keys refused) and
arrays via :mod:`quark_onnx.formats.safetensors_io`. It refuses, naming the file and the tensor and
saying what to do: a parameter file whose SHA-256 differs from the recorded one (edited or
replaced), a recipe written for another float model, shapes that disagree between ``recipe.json``,
the arrays and the float model, an unknown format version, and parameters
:meth:`QuantParams.validate` rejects.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from quark_onnx.config.quantization import Config, QuantizationConfig
from quark_onnx.errors import ModelSaveError, OutputAppearedError, QuarkOnnxError
from quark_onnx.formats import safetensors_io
from quark_onnx.formats.recipe_format import (
    FLOAT_MODEL_FILE,
    FORMAT,
    FORMAT_VERSION,
    MAX_RECIPE_BYTES,
    PARAMS_FILE,
    RECIPE_FILE,
    RecipeError,
    _document,
    _params_from_entries,
    _roundtrip,
    _write,
    config_from_json,
    first_difference,
)
from quark_onnx.model_files.files import (
    _PARTIAL_SUFFIX,
    check_path_text,
    read_regular_file,
    remove_stale_partials,
)
from quark_onnx.model_files.load import load_model, to_ir, to_proto, validate_proto
from quark_onnx.model_files.paths import check_output_path
from quark_onnx.model_files.save import save_model
from quark_onnx.params.qparams import QuantParams
from quark_onnx.pipeline.sequencer import Stages

logger = logging.getLogger(__name__)

__all__ = [
    "Recipe",
    "import_recipe",
    "load_recipe",
    "model_bytes_sha256",
    "read_recipe",
    "rebuild",
    "save_recipe",
]


@dataclass
class Recipe:
    """A recipe read from its folder (parameters checked; not yet applied to a model).

    Attributes:
        directory: the recipe folder.
        config: the quantization configuration, or None for an imported recipe.
        preset: the preset the configuration started from, if recorded.
        float_model_sha256: :func:`~quark_onnx.calibration.result.model_hash` of the float model.
        quantized_model_sha256: SHA-256 of the quantized model's serialized bytes.
        params: tensor name -> parameters, in writing order.
        shapes: tensor name -> shape recorded at save time (None: unknown, e.g. dynamic axes).
        info: the whole ``recipe.json`` document.
    """

    directory: Path
    config: QuantizationConfig | None
    preset: str | None
    float_model_sha256: str
    quantized_model_sha256: str | None
    params: dict[str, QuantParams]
    shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def imported(self) -> bool:
        """Imported from a QDQ model: no configuration, the float model is in the folder."""
        return self.config is None


def _as_qconfig(config: Config | QuantizationConfig | str | None) -> tuple[Any, str | None]:
    from quark_onnx.config.quantization import get_default_config

    if config is None:
        return None, None
    if isinstance(config, str):
        return get_default_config(config), config.upper()
    if isinstance(config, Config):
        return config.global_quant_config, None
    if isinstance(config, QuantizationConfig):
        return config, None
    raise RecipeError(
        f"config: expected a Config, a QuantizationConfig or a preset name, got "
        f"{type(config).__name__}"
    )


def _with_recorded_choices(qconfig: Any, qproto: onnx.ModelProto) -> Any:
    """``qconfig`` with what the quantization chose from its samples and a rebuild (no data)
    could not choose again: the LayerNorm scales of MigrateActivationOutliers, which the
    quantized model records as node metadata."""
    from quark_onnx.passes.migrate_activation_outliers import recorded_scales

    scales = recorded_scales(qproto)
    if qconfig is None or not scales:
        return qconfig
    extra = {**qconfig.extra_options, "MigrateActivationOutliersScales": scales}
    return dataclasses.replace(qconfig, extra_options=extra)


# ------------------------------------------------------------------------------------------------
# models
# ------------------------------------------------------------------------------------------------


def _load_float(model: onnx.ModelProto | str | os.PathLike) -> tuple[onnx.ModelProto, Path | None]:
    """The float model as :class:`~quark_onnx.pipeline.quantizer.ModelQuantizer` loads it."""

    if isinstance(model, onnx.ModelProto):
        return validate_proto(model), None
    return load_model(model), Path(model)


def _load_quantized(model: onnx.ModelProto | str | os.PathLike) -> tuple[onnx.ModelProto, str]:

    if isinstance(model, onnx.ModelProto):
        return model, "<quantized model>"
    return load_model(model, upgrade_opset=False), str(model)


def model_bytes_sha256(model: onnx.ModelProto) -> str:
    """SHA-256 of the model's deterministic serialization (what :func:`model_io.save_model`
    writes)."""
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()


def rebuild(
    float_model: onnx.ModelProto,
    config: QuantizationConfig | None,
    params: dict[str, QuantParams],
    *,
    check: Callable[[Any], None] | None = None,
) -> onnx.ModelProto:
    """Apply ``params`` to a loaded float model: the config's prepare passes, ``InsertQDQ``, the
    config's finalize passes (``config=None``: ``InsertQDQ`` alone). Runs no calibration.

    The stages are :func:`quark_onnx.pipeline.sequencer.run`'s, the order ``quantize_model`` runs
    them in, with the parameters taken from the recipe. ``check`` is called with the prepared
    ``onnx_ir`` graph before ``InsertQDQ``."""
    from quark_onnx.pipeline import sequencer

    return sequencer.run(_RecipeStages(float_model, config, params, check)).model


class _RecipeStages(Stages):
    """The pipeline's stages with the parameters taken from a recipe: no plan, no calibration,
    no accuracy stage (the recipe's codes hold its effect), no check or save."""

    def __init__(
        self,
        float_model: onnx.ModelProto,
        config: QuantizationConfig | None,
        params: dict[str, QuantParams],
        check: Callable[[Any], None] | None,
    ) -> None:
        self.float_model = float_model
        self.config = config
        self.options = config.validate() if config is not None else None
        self.params = params
        self.check_graph = check

    def load(self) -> Any:

        return to_ir(self.float_model)

    def prepare(self, model: Any) -> None:
        from quark_onnx.pipeline.prepare import quantize_passes, run_passes

        if self.config is not None:
            run_passes(model, quantize_passes(self.config, self.options))
        if self.check_graph is not None:
            self.check_graph(model.graph)

    def parameters(self, model: Any, plan: Any) -> dict[str, QuantParams]:
        return self.params

    def finalize(self, model: Any) -> onnx.ModelProto:
        from quark_onnx.pipeline.prepare import finalize_passes, run_passes

        if self.config is not None:
            run_passes(model, finalize_passes(self.config, self.options))
        return to_proto(model)


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------


def _check_outputs(directory: str | os.PathLike, inputs: list[Any]) -> None:
    """Refuse, before any work, a recipe folder whose files would replace an input (the models
    it is made from) or are not regular files
    (:func:`quark_onnx.model_files.paths.check_output_path`)."""

    out = check_path_text(directory, "recipe folder", ModelSaveError)
    paths = [m for m in inputs if isinstance(m, (str, os.PathLike))]
    if not out.is_dir():
        return  # created later; only new files go into it
    for name in (RECIPE_FILE, PARAMS_FILE, FLOAT_MODEL_FILE):
        check_output_path(out / name, inputs=paths, what=f"recipe file {name}")


def _prepare_directory(directory: str | os.PathLike, overwrite: bool) -> Path:
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ModelSaveError(f"{out}: exists and is not a folder; give a folder for the recipe")
    if (out / RECIPE_FILE).exists() and not overwrite:
        raise ModelSaveError(
            f"{out / RECIPE_FILE} exists; choose another folder or pass overwrite=True "
            "(--overwrite)"
        )
    if not out.parent.exists():
        raise ModelSaveError(f"{out}: folder {out.parent} does not exist; create it first")
    remove_stale_partials(out)
    return out


@contextlib.contextmanager
def _recipe_folder(out: Path) -> Iterator[Path]:
    """The folder to write the recipe's files into.

    A folder that exists is written into (``recipe.json`` last). A new one is built as a staging
    folder ``.<name>.<pid>.<random>.partial`` beside it and renamed into place once complete: a
    failure (a full disk) leaves no folder, and if another run created a non-empty ``out``
    meanwhile the rename fails (:class:`OutputAppearedError`) and that run's recipe is kept.
    """
    if out.is_dir():
        yield out
        return
    staging = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(6)}{_PARTIAL_SUFFIX}")
    try:
        staging.mkdir()
    except OSError as exc:
        raise ModelSaveError(f"{out}: cannot create the recipe folder ({exc.strerror})") from exc
    try:
        yield staging
        try:
            os.rename(staging, out)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise OutputAppearedError(
                    f"{out}: appeared while this run was writing the recipe (another run "
                    "writing the same folder?); it was not replaced: choose another folder"
                ) from None
            raise ModelSaveError(
                f"{out}: cannot place the recipe folder ({exc.strerror or exc})"
            ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_recipe(
    directory: str | os.PathLike,
    quantized_model: onnx.ModelProto | str | os.PathLike,
    config: Config | QuantizationConfig | str,
    float_model: onnx.ModelProto | str | os.PathLike,
    *,
    preset: str | None = None,
    verify: bool = True,
    overwrite: bool = False,
    params: dict[str, QuantParams] | None = None,
) -> Path:
    """Write the recipe of ``quantized_model`` to ``directory``; return the ``recipe.json`` path.

    The parameters are ``params`` (:attr:`ModelQuantizer.params <quark_onnx.pipeline.quantizer.
    ModelQuantizer.params>` after the quantization that wrote the model) or, when not given,
    read from the quantized model itself (:func:`quark_onnx.formats.importer.extract_params`);
    either way scales, zero points and the integer codes of every constant, so AdaRound and bias
    correction are kept, in the order the quantizer wrote them.

    Args:
        directory: the recipe folder (created; its parent must exist).
        quantized_model: the model :class:`~quark_onnx.pipeline.quantizer.ModelQuantizer` wrote
            (or its path).
        config: the configuration it was quantized with (a ``Config``, a
            ``QuantizationConfig`` or a preset name).
        float_model: the float model it was quantized from (or its path).
        preset: the preset name to record (taken from ``config`` when that is a name).
        verify: rebuild the model from the recipe in memory first and refuse to write a recipe
            that does not reproduce ``quantized_model`` byte for byte. This checks every
            setting that shapes the graph (prepare, DPU simulation and finalize passes); settings
            that only decide parameter values (calibration method, bias correction, AdaRound)
            leave no trace the rebuild could check, and a float model whose weights are all
            quantized is only identified by its structure and its float (unquantized) tensors.
        overwrite: replace a recipe already in ``directory``.
        params: the parameters the model holds (``ModelQuantizer.params``); read from
            ``quantized_model`` when None.

    Raises:
        RecipeError: ``verify`` failed (the message names the first difference; usually the
            config is not the one the model was quantized with).
        ModelSaveError: the folder cannot be written or already holds a recipe.
    """
    from quark_onnx.formats.importer import extract_params

    _check_outputs(directory, [quantized_model, float_model])
    qconfig, named = _as_qconfig(config)
    preset = preset or named
    qproto, qlabel = _load_quantized(quantized_model)
    fproto, _ = _load_float(float_model)
    qconfig = _with_recorded_choices(qconfig, qproto)
    if params is None:
        params = extract_params(qproto)
    if not params:
        raise RecipeError(
            f"{qlabel}: holds no quantized tensor (no QuantizeLinear/"
            "DequantizeLinear or Cast pair); nothing to save"
        )
    expected = model_bytes_sha256(qproto)
    if verify:
        try:
            rebuilt = rebuild(fproto, qconfig, _roundtrip(params))
        except QuarkOnnxError as exc:
            raise RecipeError(
                f"{qlabel}: its parameters do not apply to the float model ({exc}); pass the "
                "float model and configuration it was quantized with"
            ) from exc
        if model_bytes_sha256(rebuilt) != expected:
            raise RecipeError(
                f"{qlabel}: the recipe would not reproduce this model ("
                f"{first_difference(qproto, rebuilt)}); pass the configuration and float model "
                "it was quantized with"
            )
    out = _prepare_directory(directory, overwrite)
    shapes = _constant_shapes(params)
    document = _document(qconfig=qconfig, preset=preset, float_proto=fproto, quantized_sha=expected)
    with _recipe_folder(out) as folder:
        _write(folder, params, shapes, document, replace=overwrite)
    return out / RECIPE_FILE


def _constant_shapes(params: dict[str, QuantParams]) -> dict[str, tuple[int, ...] | None]:
    return {n: (tuple(p.codes.shape) if p.codes is not None else None) for n, p in params.items()}


def import_recipe(
    qdq_model: onnx.ModelProto | str | os.PathLike,
    directory: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Read a QDQ model (this project's, onnxruntime's, Quark's standard QDQ) into a recipe.

    Writes ``float_model.onnx`` (the patterns removed, see :mod:`quark_onnx.formats.importer`) and
    the recipe of its parameters, with no configuration: :func:`load_recipe` then rebuilds a model
    equivalent to ``qdq_model`` (same outputs in onnxruntime; node order may differ). Returns the
    ``recipe.json`` path.

    Raises:
        QDQImportError: the model holds a construct the importer does not read (named).
        ModelSaveError: the folder cannot be written or already holds a recipe.
    """
    from quark_onnx.formats.importer import read_qdq

    source_path = None if isinstance(qdq_model, onnx.ModelProto) else Path(qdq_model)
    _check_outputs(directory, [qdq_model])
    imported = read_qdq(qdq_model)
    if not imported.params:
        raise RecipeError(f"{imported.source}: holds no quantized tensor; nothing to import")
    fproto = imported.float_model
    assert fproto is not None
    rebuilt = rebuild(fproto, None, _roundtrip(imported.params))
    out = _prepare_directory(directory, overwrite)
    source = {"model": imported.source}
    if source_path is not None:
        source["sha256"] = _file_sha256(source_path)
    shapes = {n: imported.shapes.get(n) for n in imported.params}
    document = _document(
        qconfig=None,
        preset=None,
        float_proto=fproto,
        quantized_sha=model_bytes_sha256(rebuilt),
        source=source,
    )
    with _recipe_folder(out) as folder:
        save_model(fproto, folder / FLOAT_MODEL_FILE, input_path=source_path)
        _write(folder, imported.params, shapes, document, replace=overwrite)
    return out / RECIPE_FILE


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------


def _file_sha256(path: Path) -> str:
    """SHA-256 of a file read in pieces (a model of gigabytes is never held whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def read_recipe(directory: str | os.PathLike) -> Recipe:
    """Read and check a recipe folder (no model needed; see the module docstring).

    Raises:
        RecipeError: missing or malformed files, an unknown format version, a parameter file
            that was changed (SHA-256), inconsistent shapes, types or arrays.
    """
    folder = Path(directory)
    path = folder / RECIPE_FILE
    if not folder.is_dir():
        raise RecipeError(f"{folder}: no such recipe folder")
    if not os.path.lexists(path):  # (a FIFO or folder there is named by the read below)
        raise RecipeError(
            f"{path}: missing; {folder} is not a recipe folder (write one with save_recipe or "
            "`quark-onnx export --format recipe`)"
        )

    source = str(path)
    text = read_regular_file(path, limit=MAX_RECIPE_BYTES, what="recipe file", error=RecipeError)
    try:
        doc = json.loads(
            text.decode("utf-8"), object_pairs_hook=safetensors_io.reject_duplicate_keys
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # (RecursionError: nested deeper than the JSON parser's recursion limit)
        raise RecipeError(
            f"{source}: not a readable JSON recipe ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecipeError(f"{source}: not a quark_onnx recipe (format must be {FORMAT!r})")
    version = doc.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise RecipeError(f"{source}: format_version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise RecipeError(
            f"{source}: format_version {version} is newer than this quark_onnx reads "
            f"({FORMAT_VERSION}); upgrade quark_onnx"
        )
    float_info = doc.get("float_model")
    if not isinstance(float_info, dict) or not isinstance(float_info.get("sha256"), str):
        raise RecipeError(f"{source}: 'float_model' must record the float model's sha256")
    quant_info = doc.get("quantized_model")
    quantized_sha = quant_info.get("sha256") if isinstance(quant_info, dict) else None
    params_info = doc.get("params")
    if (
        not isinstance(params_info, dict)
        or params_info.get("file") != PARAMS_FILE
        or not isinstance(params_info.get("sha256"), str)
    ):
        raise RecipeError(f"{source}: 'params' must name {PARAMS_FILE!r} and record its sha256")
    preset = doc.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise RecipeError(f"{source}: 'preset' must be a string or null")
    config = None if doc.get("config") is None else config_from_json(doc["config"], source)
    params_path = folder / PARAMS_FILE
    if not os.path.lexists(params_path):
        raise RecipeError(f"{params_path}: missing; copy the whole recipe folder")
    try:
        arrays, _meta = safetensors_io.load_file(params_path, sha256=params_info["sha256"])
    except safetensors_io.SafetensorsError as exc:
        raise RecipeError(str(exc)) from exc
    params, shapes = _params_from_entries(doc.get("tensors"), arrays, source, str(params_path))
    return Recipe(
        directory=folder,
        config=config,
        preset=preset,
        float_model_sha256=float_info["sha256"],
        quantized_model_sha256=quantized_sha if isinstance(quantized_sha, str) else None,
        params=params,
        shapes=shapes,
        info=doc,
    )


def _check_against_model(recipe: Recipe, fproto: onnx.ModelProto, label: str) -> None:
    from quark_onnx.calibration.result import model_hash

    digest = model_hash(fproto)
    if digest != recipe.float_model_sha256:
        recorded = recipe.info.get("float_model", {}).get("graph_name")
        raise RecipeError(
            f"{recipe.directory / RECIPE_FILE}: written for another float model (graph "
            f"{recorded!r}, identity {recipe.float_model_sha256[:16]}...), not {label} (graph "
            f"{fproto.graph.name!r}, identity {digest[:16]}...); pass the float model the recipe "
            "was saved from, or quantize this model again"
        )


def _check_shapes(recipe: Recipe, graph: Any) -> None:
    """The recorded constant shapes against the prepared float graph's tensors (before
    InsertQDQ, whose own check would name no file)."""
    from quark_onnx.graph.ir import constant_array

    values: dict[str, Any] = dict(graph.initializers)
    for node in graph:
        for out in node.outputs:
            if out.name:
                values[out.name] = out
    for v in graph.inputs:
        values.setdefault(v.name or "", v)
    for name, p in recipe.params.items():
        value = values.get(name)
        where = f"{recipe.directory / RECIPE_FILE}: tensor {name!r}"
        if value is None:
            raise RecipeError(
                f"{where} is not in the (prepared) float model; the recipe does not belong to "
                "this model or configuration"
            )
        if p.codes is None:
            continue
        array = constant_array(value)
        if array is None:
            raise RecipeError(f"{where} has codes but is not a constant of the float model")
        if tuple(array.shape) != tuple(p.codes.shape):
            raise RecipeError(
                f"{where}: the recipe's codes have shape {list(p.codes.shape)} but the float "
                f"model's tensor has shape {list(array.shape)}; the recipe was edited or belongs "
                "to another model"
            )


def load_recipe(
    directory: str | os.PathLike,
    float_model: onnx.ModelProto | str | os.PathLike | None = None,
    output: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
) -> onnx.ModelProto:
    """Rebuild the quantized model from a recipe and its float model, without calibration.

    Args:
        directory: the recipe folder.
        float_model: the float model the recipe was saved from (path or proto); None for an
            imported recipe (its ``float_model.onnx`` is used).
        output: also write the model here (atomically; never over the float model or a
            recipe file).
        overwrite: replace an existing ``output``; without it the output is placed exclusively
            (``OutputAppearedError`` if it exists by then: another run wrote it).

    Returns:
        The quantized model; byte-identical to the one the recipe was saved from.

    Raises:
        RecipeError: see :func:`read_recipe`; the float model is not the recipe's; or the rebuilt
            model is not the one the recipe records (its ``quantized_model.sha256``): the
            parameters were edited (even with their own checksum recomputed) or the recipe was
            written by another quark_onnx/onnx version.
    """

    if output is not None:  # before any work: never over the float model or the recipe
        folder = Path(directory)
        check_output_path(
            output,
            float_model if isinstance(float_model, (str, os.PathLike)) else None,
            overwrite,
            inputs=[folder / RECIPE_FILE, folder / PARAMS_FILE, folder / FLOAT_MODEL_FILE],
        )
    recipe = read_recipe(directory)
    if float_model is None:
        if not recipe.imported:
            raise RecipeError(
                f"{recipe.directory / RECIPE_FILE}: give the float model the recipe was saved "
                "from (float_model=..., --float-model)"
            )
        float_model = recipe.directory / FLOAT_MODEL_FILE
    fproto, fpath = _load_float(float_model)
    label = str(fpath) if fpath is not None else "the given float model"
    _check_against_model(recipe, fproto, label)
    quantized = rebuild(
        fproto, recipe.config, recipe.params, check=lambda graph: _check_shapes(recipe, graph)
    )
    if (
        recipe.quantized_model_sha256 is not None
        and model_bytes_sha256(quantized) != recipe.quantized_model_sha256
    ):
        raise RecipeError(
            f"{recipe.directory / RECIPE_FILE}: the rebuilt model is not the one the recipe "
            f"records (quantized_model.sha256 {recipe.quantized_model_sha256[:16]}..., rebuilt "
            f"{model_bytes_sha256(quantized)[:16]}...): its parameters or configuration were "
            "edited, or it was written by another quark_onnx/onnx version; export the recipe "
            "again from the quantized model"
        )
    if output is not None:
        save_model(quantized, output, input_path=fpath, overwrite=overwrite, replace=overwrite)
    return quantized
