"""Fuzzing the command line's arguments: special files in every file argument of every
subcommand, and values of the wrong type for every ``--set`` option.

Each case runs :func:`quark_onnx.cli.main` in this process (milliseconds for a refusal) and passes
when the command either succeeds or prints exactly one ``error:`` line with no traceback and no
"internal error", names what is at fault, leaves every input's bytes as they were and no
``.partial`` file behind.

* special files: a FIFO, a symbolic link to ``/dev/zero``, a folder and a broken symbolic link,
  each given as every file argument (models, calibration data, saved calibrations, manifests,
  recipes, reports, outputs). A special file that exists is never reported as missing.
* ``--set`` values: for every QuantizationConfig field and every extra option, values of types
  its declared type does not take (a list for a bool, a string for a number, ...): a usage error
  (exit code 2) naming the option.

The cases are a seeded sample of the whole matrix, ``QUARK_FUZZ_CLI_CASES`` of each family
(default 40, every file argument among them: a few seconds); ``QUARK_FUZZ_CLI_CASES=0`` runs
every case, ``QUARK_FUZZ_SEED`` (an integer) draws another sample. A command waiting on a FIFO
is released after 10 s and its case fails; any case still running after
``QUARK_FUZZ_CASE_TIMEOUT`` seconds (default 120) aborts the run with every thread's traceback.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import os
import random
import threading
import typing
from pathlib import Path

import numpy as np
import pytest
from fuzz_models import IMAGE, conv_chain, quantizer

from quark_onnx.cli import main
from quark_onnx.config.options import ExtraOptions, option_fields
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.formats.recipe import save_recipe

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")

CASES = int(os.environ.get("QUARK_FUZZ_CLI_CASES", "40"))
SEED = (
    int(os.environ.get("QUARK_FUZZ_SEED", "0"))
    if os.environ.get("QUARK_FUZZ_SEED", "").lstrip("-").isdigit()
    else 0
)
CASE_TIMEOUT = float(os.environ.get("QUARK_FUZZ_CASE_TIMEOUT", "120"))

#: kind -> what the one error line must say when the argument is read (None: anything named)
KINDS = {
    "fifo": "is a FIFO",
    "device": "is a device",
    "folder": None,  # a folder is a legitimate value of some arguments (-o, --calib DIR)
    "broken-link": None,
}

#: Every file argument of every subcommand; ``X`` is where the special file goes.
ARGUMENTS: dict[str, list[str]] = {
    "quantize MODEL": ["quantize", "X", "-o", "out", "--random-calib", "1"],
    "quantize -o": ["quantize", "m.onnx", "-o", "X", "--random-calib", "1"],
    "quantize --manifest": ["quantize", "--manifest", "X", "-o", "out"],
    "quantize --calib": ["quantize", "m.onnx", "-o", "out", "--calib", "X"],
    "quantize --load-calibration": ["quantize", "m.onnx", "-o", "out", "--load-calibration", "X"],
    "check MODEL": ["check", "X"],
    "compare FLOAT": ["compare", "X", "q.onnx", "--random", "1"],
    "compare QUANTIZED": ["compare", "m.onnx", "X", "--random", "1"],
    "compare --data": ["compare", "m.onnx", "q.onnx", "--data", "X"],
    "compare --json": [
        "compare", "m.onnx", "q.onnx", "--random", "1", "--no-layers", "--json", "X",
    ],
    "export MODEL": ["export", "X", "--format", "onnx", "-o", "e.onnx"],
    "export -o": ["export", "q.onnx", "--format", "onnx", "-o", "X"],
    "export --float-model": [
        "export", "q.onnx", "--format", "recipe", "-o", "r2", "--float-model", "X",
        "--config", "XINT8",
    ],
    "export --report": [
        "export", "q.onnx", "--format", "recipe", "-o", "r3", "--float-model", "m.onnx",
        "--report", "X",
    ],
    "import SOURCE": ["import", "X", "-o", "i.onnx"],
    "import -o": ["import", "q.onnx", "-o", "X"],
    "import --float-model": ["import", "rec", "-o", "i2.onnx", "--float-model", "X"],
}  # fmt: skip


def _sample(cases: list, count: int) -> list:
    if count <= 0 or count >= len(cases):
        return cases
    return random.Random(SEED).sample(cases, count)


def _tree_digest(folder: Path) -> dict[str, bytes]:
    """The hash of every regular file under ``folder`` (special files are not read)."""
    out = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).digest()
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """A folder of valid inputs: m.onnx (float), q.onnx (its XINT8 model), rec/ (its recipe),
    m.report.json, c.npz, m.calibration.json."""
    folder = tmp_path_factory.mktemp("inputs")
    model = conv_chain()
    (folder / "m.onnx").write_bytes(model.SerializeToString())
    q = quantizer(samples=2)
    quantized = q.quantize_model(
        folder / "m.onnx", folder / "q.onnx", save_calibration=folder / "m.calibration.json"
    )
    q.report.save(folder / "m.report.json")
    save_recipe(folder / "rec", quantized, q.config_in_force, model, params=q.params)
    rng = np.random.default_rng(0)
    np.savez(folder / "c.npz", x=rng.standard_normal([4, *IMAGE[1:]]).astype(np.float32))
    return folder


#: Seconds after which a reader still waiting on a FIFO is released (the case then fails).
FIFO_WAIT = 10.0


class _FifoWatch:
    """Releases a command blocked opening or reading ``fifo`` (by opening its other end after
    :data:`FIFO_WAIT` seconds: the reader sees its end), so that the case fails with a message
    instead of hanging the run; :attr:`released` says whether it had to."""

    def __init__(self, fifo: Path | None) -> None:
        self.fifo, self.released = fifo, False
        self._timer = threading.Timer(FIFO_WAIT, self._release)
        self._timer.daemon = True

    def _release(self) -> None:
        try:
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)  # fails with no reader
        except OSError:
            return
        self.released = True
        os.close(fd)

    def __enter__(self) -> _FifoWatch:
        if self.fifo is not None:
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()


def _run(argv: list[str], cwd: Path, capfd, fifo: Path | None = None) -> tuple[int, str]:
    faulthandler.dump_traceback_later(CASE_TIMEOUT, exit=True)
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with _FifoWatch(fifo) as watch:
            code = main(argv)
    finally:
        os.chdir(previous)
        faulthandler.cancel_dump_traceback_later()
    assert not watch.released, f"{' '.join(argv)}: waited on the FIFO {fifo.name}"
    return code, capfd.readouterr().err


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    assert "internal error" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def _special(folder: Path, kind: str) -> Path:
    path = folder / f"special-{kind}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to(folder / "nowhere")
    return path


#: Cases that once failed, always run: a manifest that is a FIFO was opened and waited on.
REGRESSIONS = [("quantize --manifest", "fifo")]


def _special_cases() -> list[tuple[str, str]]:
    """Every file argument once (a kind drawn by the seed), the regressions, then more of the
    matrix up to ``CASES``."""
    everything = [(arg, kind) for arg in ARGUMENTS for kind in KINDS]
    if CASES <= 0:
        return everything
    rnd = random.Random(SEED)
    chosen = list(REGRESSIONS)
    for arg in ARGUMENTS:
        case = (arg, rnd.choice(sorted(KINDS)))
        if case not in chosen:
            chosen.append(case)
    rest = [case for case in everything if case not in chosen]
    return chosen + rnd.sample(rest, max(0, min(len(rest), CASES - len(chosen))))


SPECIAL_CASES = _special_cases()


@pytest.mark.parametrize(("argument", "kind"), SPECIAL_CASES)
def test_a_special_file_in_a_file_argument(inputs, tmp_path, capfd, argument, kind):
    for item in inputs.iterdir():  # each case in a fresh folder: its outputs and specials
        target = tmp_path / item.name
        if item.is_dir():
            target.symlink_to(item, target_is_directory=True)
        else:
            target.write_bytes(item.read_bytes())
    before = _tree_digest(inputs)
    special = _special(tmp_path, kind)
    argv = [special.name if a == "X" else a for a in ARGUMENTS[argument]]
    code, err = _run(argv, tmp_path, capfd, special if kind == "fifo" else None)
    if code != 0:
        line = _one_error_line(err)
        if KINDS[kind] is not None and "is a" in line:
            assert KINDS[kind] in line, line
        # what is missing may be a file the folder was to hold (--load-calibration DIR)
        if kind != "broken-link" and f"{special.name}/" not in line:
            assert "no such" not in line and "not found" not in line, line
        assert special.name in line or argument.split()[-1] in line, line
    assert _tree_digest(inputs) == before
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".partial")]
    if kind == "device":
        assert special.is_symlink() and os.readlink(special) == "/dev/zero"


# --- --set values of the wrong type ------------------------------------------------------------

#: declared type -> JSON literals of types it does not take
WRONG: dict[type, list[str]] = {
    bool: ["3", "[true]", '{"a": 1}', '"maybe"', "1.5"],
    int: ["true", "1.5", '"many"', "[1]", '{"a": 1}'],
    float: ["true", '"much"', "[0.5]", '{"a": 1}'],
    str: ["3", "[1]", '{"a": 1}', "true"],
    list: ["3", "true", '{"a": 1}', "1.5"],
    dict: ["[1]", "3", "true", '"text"'],
}


def _declared(annotation: object) -> type | None:
    origin = typing.get_origin(annotation) or annotation
    return origin if origin in WRONG else None


def _set_cases() -> list[tuple[str, str]]:
    cases = []
    hints = typing.get_type_hints(ExtraOptions)
    for f in option_fields():
        kind = _declared(hints[f.name])
        cases += [(f.name, value) for value in WRONG.get(kind, [])] if kind else []
    config_hints = typing.get_type_hints(QuantizationConfig)
    for f in dataclasses.fields(QuantizationConfig):
        if f.name == "extra_options":
            continue
        kind = _declared(config_hints[f.name])
        if kind is None:  # the enum fields (activation_type, ...): neither a name nor a string
            cases += [(f.name, value) for value in ["3", "[1]", "true"]]
        else:
            cases += [(f.name, value) for value in WRONG[kind]]
    return cases


ALL_SET_CASES = _set_cases()
SET_CASES = _sample(ALL_SET_CASES, CASES)


def test_every_option_has_wrong_values_to_try():
    named = {name for name, _ in ALL_SET_CASES}
    assert {f.name for f in option_fields()} <= named
    assert {f.name for f in dataclasses.fields(QuantizationConfig)} - {"extra_options"} <= named


@pytest.mark.parametrize(("option", "value"), SET_CASES)
def test_a_set_value_of_the_wrong_type_is_a_named_usage_error(inputs, capfd, option, value):
    argv = ["quantize", "m.onnx", "-o", "out", "--random-calib", "1", "--set", f"{option}={value}"]
    before = _tree_digest(inputs)
    code, err = _run(argv, inputs, capfd)
    line = _one_error_line(err)
    assert code == 2, err
    assert option in line, line
    assert _tree_digest(inputs) == before
    assert not (inputs / "out").exists()
