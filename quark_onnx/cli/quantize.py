"""``quark-onnx quantize MODEL_OR_FOLDER... -o OUT_DIR``: quantize one or many models.

With a preset (``--config``, default XINT8) plus ``--set KEY=VALUE`` overrides. For each model
``NAME.onnx`` it writes ``OUT_DIR/NAME.onnx``, the JSON report ``OUT_DIR/NAME.report.json``
(:meth:`QuantizationReport.save`), a readable summary ``OUT_DIR/NAME.report.txt`` and, when data
allows a float-vs-quantized comparison, ``OUT_DIR/NAME.compare.json``
(:func:`quark_onnx.fidelity.compare.compare_models` on the first ``--compare-samples`` calibration
samples). A failing model prints one line ``error: MODEL: MESSAGE`` (the traceback only with
``--debug``) and the others go on; a summary table ends the run; the exit code is 1 when any model
failed. ``--jobs N`` quantizes N models at once in processes started with the ``spawn`` method
(onnxruntime and ``fork`` do not mix); each model is quantized by the same code with the same
settings whatever N is, so outputs are identical.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from pathlib import Path
from typing import Any

from quark_onnx.cli.batch import (
    BatchInterrupted,
    Console,
    collect_models,
    output_names,
    run_batch,
    stop_resource_tracker,
    summary_table,
)
from quark_onnx.cli.calibration import COMPARE_BUDGET, DEFAULT_COMPARE_SAMPLES
from quark_onnx.cli.common import (
    DEFAULT_PRESET,
    EXIT_FAILED,
    EXIT_OK,
    Formatter,
    add_output,
    add_settings,
    log_level,
    preset_names,
    require_file,
    wrap,
)
from quark_onnx.cli.jobs import Job
from quark_onnx.cli.manifest import BatchModel, read_manifest
from quark_onnx.cli.settings import QuantizeSettings, parse_assignments
from quark_onnx.errors import ConfigError, ModelSaveError
from quark_onnx.model_files.files import Terminated, check_path_text

logger = logging.getLogger("quark_onnx.cli")

NPZ_SUFFIXES = (".npz", ".npy")


def check_calibration(
    calib: str | None, preprocess: str | None, random_calib: int | None, where: str = ""
) -> None:
    """Usage errors of one model's calibration settings (``where``: the manifest entry, or ""
    for the command line's flags)."""
    at = f"{where}: " if where else ""
    if calib is not None:
        p = Path(calib)
        if not p.exists():
            raise ConfigError(f"{at}--calib {calib}: no such file or folder")
        if not p.is_dir():
            require_file(calib, f"{at}--calib", ".npz/.npy file or image folder")
        if p.is_file() and p.suffix.lower() not in NPZ_SUFFIXES:
            raise ConfigError(
                f"{at}--calib {calib}: expected a .npz/.npy file or a folder of images"
            )
        if p.is_file() and preprocess is not None:
            raise ConfigError(f"{at}--preprocess applies to an image folder given with --calib DIR")
        if p.is_dir() and preprocess is None:
            from quark_onnx.calibration.image_spec import PreprocessSpec

            logger.warning(
                "%s--calib %s is an image folder and no --preprocess is given: using %s",
                at,
                calib,
                PreprocessSpec().to_string(),
            )
    elif preprocess is not None:
        raise ConfigError(f"{at}--preprocess needs --calib DIR (a folder of images)")
    if random_calib is not None and random_calib < 1:
        raise ConfigError(f"{at}--random-calib {random_calib}: expected a positive number")


#: The flags a manifest gives per model (not on the command line with --manifest).
MANIFEST_FLAGS = {
    "calib": "--calib",
    "random_calib": "--random-calib",
    "preprocess": "--preprocess",
    "calib_limit": "--calib-limit",
    "exclude": "--exclude",
}


def _check_flags(args: argparse.Namespace) -> None:
    """Usage errors of the flags alone, before any model is read."""
    if args.manifest is not None:
        if args.models:
            raise ConfigError(
                "--manifest names the models: leave out MODEL_OR_FOLDER (or add them to the "
                "manifest as [[model]] tables)"
            )
        given = [flag for key, flag in MANIFEST_FLAGS.items() if getattr(args, key) is not None]
        if given:
            raise ConfigError(
                f"{', '.join(given)} with --manifest: set it in the manifest (at the top for "
                "every model, or in a [[model]] table)"
            )
    elif not args.models:
        raise ConfigError("no model: give MODEL_OR_FOLDER... or --manifest FILE.toml")
    else:
        check_calibration(args.calib, args.preprocess, args.random_calib)
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: expected a positive number")
    if args.calib_limit is not None and args.calib_limit < 1:
        raise ConfigError(f"--calib-limit {args.calib_limit}: expected a positive number")
    if args.compare_samples is not None and args.compare_samples < 0:
        raise ConfigError(
            f"--compare-samples {args.compare_samples}: expected 0 (no comparison) or more"
        )
    if args.calib_shards < 1:
        raise ConfigError(f"--calib-shards {args.calib_shards}: expected a positive number")
    if args.ray is not None:
        from quark_onnx.cli.ray_runner import import_ray

        if args.jobs > 1:
            raise ConfigError("--ray runs every model as a Ray task: leave out --jobs")
        import_ray()  # not installed: say how to install it, before any model


def _settings(args: argparse.Namespace) -> QuantizeSettings:
    """The picklable settings every job is quantized with."""
    calib = args.calib
    exclude = tuple(n for item in args.exclude or () for n in item.split(",") if n)
    return QuantizeSettings(
        preset=args.config,
        assignments=tuple(parse_assignments(args.set or ())),
        exclude=exclude,
        random_samples=args.random_calib,
        calib=str(Path(calib).resolve()) if calib is not None else None,
        preprocess=args.preprocess,
        calib_limit=args.calib_limit,
        compare_samples=args.compare_samples,
        compare_layers=args.compare_layers or args.report_html,  # the HTML's per-layer chart
        fix_shapes_from_calib=args.fix_shapes_from_calib,
        save_calibration=args.save_calibration,
        load_calibration=args.load_calibration,
        overwrite=args.overwrite,
        log_level=log_level(args),
        require_fidelity=args.require_fidelity,
        fidelity_target=args.fidelity_target,
        require_ready=args.require_ready,
        report_html=args.report_html,
        calib_shards=args.calib_shards,
        shard_backend="ray" if args.ray is not None else "processes",
    )


def _check_settings(settings: QuantizeSettings, load: str | None, where: str = "") -> None:
    """Usage errors of one model's settings, before any model is read: a bad spec, an unknown
    preset or option, no calibration data."""
    at = f"{where}: " if where else ""
    try:
        settings.preprocess_spec()
        qconfig = settings.build_config()
    except ConfigError as exc:
        if not where:
            raise
        raise ConfigError(f"{at}{exc}") from None
    if (
        settings.calib is None
        and not qconfig.resolved_options().UseRandomData
        and load is None
        and qconfig.needs_calibration_data()
    ):
        source = "calib, random_calib" if where else "--calib FILE.npz|DIR, --random-calib N"
        raise ConfigError(f"{at}no calibration data: give {source} or --load-calibration PATH")


def _models(args: argparse.Namespace, settings: QuantizeSettings) -> list[BatchModel]:
    """The batch: the manifest's models with their own settings, or the given models (folders
    expanded) all with the command line's."""
    if args.manifest is not None:
        entries = read_manifest(args.manifest, settings)
        for entry in entries:
            where, own = f"{args.manifest}, {entry.name}", entry.settings
            check_calibration(own.calib, own.preprocess, own.random_samples, where)
            _check_settings(own, args.load_calibration, where)
        output_names([e.model for e in entries], [e.name for e in entries])
        return entries
    _check_settings(settings, args.load_calibration)
    models = collect_models(args.models)
    names = output_names(models)
    return [BatchModel(m, n, settings) for m, n in zip(models, names, strict=True)]


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    entries = _models(args, _settings(args))
    load = args.load_calibration
    if load is not None and len(entries) > 1 and not Path(load).is_dir():
        raise ConfigError(
            "--load-calibration with several models expects a folder holding "
            "NAME.calibration.json files (as written by --save-calibration)"
        )
    out_dir = check_path_text(args.output, "-o", ConfigError)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"-o {out_dir}: exists and is not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSaveError(
            f"-o {out_dir}: cannot create the output folder ({exc.strerror or exc}); choose a "
            "writable folder"
        ) from exc
    jobs = [
        Job(index=i, model=str(e.model), name=e.name, out_dir=str(out_dir.resolve()),
            settings=e.settings, debug=bool(args.debug))
        for i, e in enumerate(entries)
    ]  # fmt: skip
    console = Console(len(jobs), quiet=args.quiet)
    stopped_by = None
    if args.ray is not None:
        from quark_onnx.cli.ray_runner import run_batch_ray

        # Ray's own wait turns Ctrl-C / SIGTERM into KeyboardInterrupt / Terminated
        outcomes = run_batch_ray(
            jobs, console, args.debug, address=args.ray or None, task_cpus=args.ray_cpus
        )
    else:
        try:
            outcomes = run_batch(jobs, args.jobs, console, args.debug)
        except BatchInterrupted as stop:
            outcomes, stopped_by = stop.outcomes, stop.signal_name
    # (outside the handler: the pool, referenced by the interrupted frames, is gone by now)
    gc.collect()
    stop_resource_tracker()
    if args.manifest is not None:  # each model's own settings, in the summary
        for outcome in outcomes:
            outcome.settings_text = jobs[outcome.index].settings.describe()
    else:  # one calibration source for all: does it fit each model?
        from quark_onnx.cli.consistency import batch_warnings

        for warning in batch_warnings(outcomes):
            logger.warning("%s", warning)
    if not args.quiet:  # -q: errors only (a failed model's line is on stderr already)
        print(summary_table(outcomes))
    if args.report_html:
        from quark_onnx.pipeline.report_html import write_batch_page

        write_batch_page(out_dir, outcomes)
    if stopped_by is not None:
        finished = sum(o.ok for o in outcomes)
        print(
            f"stopped by {stopped_by}: {finished} model(s) finished and written, "
            f"{len(outcomes) - finished} not (nothing of them was left)",
            file=sys.stderr,
        )
        raise Terminated(stopped_by) if stopped_by == "SIGTERM" else KeyboardInterrupt
    if args.require_ready and any(o.ok and o.ready is False for o in outcomes):
        return EXIT_FAILED
    return EXIT_FAILED if any(not o.ok for o in outcomes) else EXIT_OK


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``quantize`` subcommand to ``sub``."""
    q = sub.add_parser(
        "quantize",
        parents=[common],
        formatter_class=Formatter,
        help="quantize one or many models",
        description=wrap(
            "Quantize ONNX models. For each MODEL.onnx write OUT_DIR/MODEL.onnx, "
            "OUT_DIR/MODEL.report.json, OUT_DIR/MODEL.report.txt and (when there is data) "
            "OUT_DIR/MODEL.compare.json. A failing model prints one `error:` line and the others "
            "go on; the exit code is 1 when any model failed, or with --require-ready when a "
            "model is not Vitis AI-ready (without it a not-ready model is written, reported and "
            "the exit code is 0)."
        ),
        epilog="examples:\n"
        "  quark-onnx quantize model.onnx -o out --calib calib.npz\n"
        "  quark-onnx quantize models/ -o out --random-calib 16 --jobs 2\n"
        "  quark-onnx quantize models/ -o out --calib calib.npz --ray auto --calib-shards 4\n"
        "  quark-onnx quantize squeezenet.onnx -o out --calib images/ \\\n"
        "      --preprocess 'resize=256,crop=224,mean=104;117;123,order=BGR'\n"
        "  quark-onnx quantize --manifest models.toml -o out   (each model its own settings)\n"
        "  quark-onnx quantize model.onnx -o out --calib calib.npz --set include_cle=true \\\n"
        "      --set ActivationSymmetric=true --exclude /head/Gemm",
    )
    q.add_argument(
        "models",
        nargs="*",
        metavar="MODEL_OR_FOLDER",
        help="ONNX model files, or folders whose *.onnx files are all quantized (or --manifest)",
    )
    q.add_argument(
        "--manifest",
        metavar="FILE.toml",
        help="the models to quantize, each with its own calibration data, pre-processing, "
        "preset and options, defaults at the top (see docs/cli.md); the summary shows each "
        "model's settings",
    )
    add_output(q, "OUT_DIR", "folder for the quantized models and reports (created if missing)")
    add_settings(
        q,
        default=DEFAULT_PRESET,
        preset_help=f"the preset to start from (default {DEFAULT_PRESET}; one of "
        f"{', '.join(preset_names())}; see `quark-onnx presets`)",
        set_help="override a QuantizationConfig field (include_cle=true, calibrate_method="
        "NonOverflow) or an extra option (ActivationSymmetric=false); VALUE is a JSON literal, "
        "else a string; repeat for several (see `quark-onnx options`)",
    )
    _add_calibration_flags(q)
    _add_run_flags(q)
    q.set_defaults(func=run)


def _add_calibration_flags(q: argparse.ArgumentParser) -> None:
    data = q.add_argument_group(
        "calibration data (one of --calib, --random-calib, --load-calibration)"
    )
    source = data.add_mutually_exclusive_group()
    source.add_argument(
        "--calib",
        metavar="FILE_OR_DIR",
        help="a .npz/.npy file of input samples (axis 0; one array per input, named like the "
        "input, for multi-input models) or a folder of JPEG/PNG images (with --preprocess)",
    )
    source.add_argument(
        "--random-calib",
        type=int,
        metavar="N",
        help="calibrate on N reproducible random samples shaped like the model input "
        "(UseRandomData=true, RandomDataSamples=N); for testing, not for accuracy",
    )
    data.add_argument(
        "--preprocess",
        metavar="SPEC",
        help="pre-processing of the images of --calib DIR, key=value items: resize=N (short "
        "side) or resize=short|long|fit|stretch|height with size=HxW (height first) or size=N; "
        "letterbox (= resize=fit), pad=V (value of padded elements after normalisation), "
        "align=center|topleft, crop=N or HxW, multiple=M, grayscale, scale, mean, std, "
        "order=RGB|BGR, layout=NCHW|NHWC. E.g. classifier 'resize=256,crop=224,scale=1/255,"
        "mean=0.485;0.456;0.406,std=0.229;0.224;0.225'; YOLOX 'letterbox,size=640,pad=114,"
        "order=BGR'; OCR 'resize=height,size=48x192,scale=1/255,mean=0.5,std=0.5,order=BGR'. "
        "Checked against the model input shape; a mismatch error proposes specs that fit",
    )
    data.add_argument(
        "--calib-limit",
        type=int,
        metavar="N",
        help="use only the first N calibration samples (sets CalibDataSize)",
    )
    data.add_argument(
        "--save-calibration",
        action="store_true",
        help="also write OUT_DIR/MODEL.calibration.json (the calibration statistics) and "
        "MODEL.calibration.npz (the few samples the preparation passes measured) so that "
        "re-quantizing with other options can skip calibration, with or without data",
    )
    data.add_argument(
        "--load-calibration",
        metavar="PATH",
        help="use calibration statistics saved by --save-calibration instead of running the "
        "model: a file (one model) or a folder holding MODEL.calibration.json; without --calib "
        "the MODEL.calibration.npz beside it prepares the model as the saving run did",
    )
    data.add_argument(
        "--calib-shards",
        type=int,
        default=1,
        metavar="K",
        help="calibrate K contiguous parts of the data in parallel (K processes, or K Ray tasks "
        "with --ray) and merge their statistics; the output is byte-identical (default 1)",
    )


def _add_run_flags(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--exclude",
        action="extend",
        nargs="+",
        metavar="NODE",
        help="keep these nodes in float (nodes_to_exclude); names may also be comma-separated; "
        "put the flag after the models, the node list ends at the next flag",
    )
    q.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="quantize N models at once in separate processes (default 1); the outputs do not "
        "depend on N",
    )
    q.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="quantize every model as a Ray task (needs: pip install 'quark_onnx[ray]'): on the "
        "cluster at ADDRESS (host:6379 from `ray start --head`, `auto`, or ray://HOST:10001), "
        "else RAY_ADDRESS, else a local cluster started for this run; the outputs are those of "
        "--jobs; models, data and OUT_DIR must be on paths every node sees",
    )
    q.add_argument(
        "--ray-cpus",
        type=float,
        default=1.0,
        metavar="N",
        help="CPUs Ray reserves for each model's task (default 1)",
    )
    q.add_argument(
        "--compare-samples",
        type=int,
        default=None,
        metavar="N",
        help="compare the quantized model with the float model on the first N calibration "
        f"samples (default {DEFAULT_COMPARE_SAMPLES}, fewer for inputs above "
        f"{COMPARE_BUDGET // DEFAULT_COMPARE_SAMPLES} values: at most {COMPARE_BUDGET} "
        "input values in all; 0: do not compare): SQNR and cosine of every output, top-1 "
        "(score vectors) or per-pixel argmax (dense outputs) agreement",
    )
    q.add_argument(
        "--compare-layers",
        action="store_true",
        help="also compare every quantized activation (per-layer SQNR in MODEL.compare.json; "
        "runs both models with all intermediate tensors as outputs: slower, more memory)",
    )
    q.add_argument(
        "--report-html",
        action="store_true",
        help="also write OUT_DIR/MODEL.report.html (fidelity per output, per-layer error chart, "
        "NPU/CPU partition, pass costs, time and memory per stage; one self-contained file; "
        "implies --compare-layers) and OUT_DIR/index.html, the batch's page",
    )
    q.add_argument(
        "--fix-shapes-from-calib",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write a dynamic-shape model with the one static shape of its calibration data "
        "(sets FixShapes, stated in the report); default: on for NPU presets (XINT8), off for "
        "the others (which then log the FixShapes value that would do it)",
    )
    q.add_argument(
        "--overwrite",
        action="store_true",
        help="replace existing outputs in OUT_DIR (default: a model whose output exists fails)",
    )
    q.add_argument(
        "--require-ready",
        action="store_true",
        help="exit with code 1 also when a quantized model is not Vitis AI-ready (without it "
        "a not-ready model is written, reported and exits 0)",
    )
    q.add_argument(
        "--fidelity-target",
        metavar="TARGET",
        default=None,
        help="e.g. sqnr=20,agreement=0.95: the thresholds every output part must meet; a "
        "model that misses them after the repair gets the fewest promoted tensors that meet "
        "them (XINT8: float on the CPU; float scales: 16-bit), within MixedPrecisionBudget "
        "(extra option FidelityTarget)",
    )
    q.add_argument(
        "--require-fidelity",
        action="store_true",
        help="fail a model (no output written, exit code 1) whose outputs do not follow the "
        "float model's (extra option RequireFidelity; thresholds FidelityMinSQNR, "
        "FidelityMinAgreement)",
    )
