"""The README stays true and short: its examples run, its tables name every preset, its links
resolve, the CI test command is the README's, and the options reference in docs/ is the one the
schema generates."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from quark_onnx.cli.options import markdown
from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.presets import preset_names

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
OPTIONS_DOC = ROOT / "docs" / "options.md"


def _section(title: str) -> str:
    match = re.search(rf"^## {title}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)\n```", README, re.S)


def test_readme_is_short_and_undated() -> None:
    assert len(README.splitlines()) <= 300
    dates = re.findall(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", README)
    assert not dates, f"dated lines in the README: {dates}"
    for word in ("../shared", "the seed", "snippet", "shared models"):
        assert word not in README, f"the README speaks of {word!r}, which a user's clone lacks"


def test_options_reference_is_generated_from_the_schema() -> None:
    """``quark-onnx options --markdown > docs/options.md`` regenerates the committed file."""
    assert OPTIONS_DOC.read_text(encoding="utf-8") == markdown(), (
        "docs/options.md is stale: run `quark-onnx options --markdown > docs/options.md`"
    )
    missing = [
        f.name for f in dataclasses.fields(ExtraOptions) if f"| `{f.name}` |" not in markdown()
    ]
    assert not missing


def test_every_preset_is_in_the_presets_table() -> None:
    table = _section("Presets")
    missing = [name for name in preset_names() if f"| `{name}` |" not in table]
    assert not missing, f"presets missing from the README table: {missing}"


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    commands = _blocks("bash")
    assert len(commands) >= 2, "the README starts with the install-and-run and the test commands"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] in ci.splitlines()


def test_links_resolve() -> None:
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert targets
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"
    for doc in (ROOT / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A working folder in which the README's relative paths (``examples/...``) resolve."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


@pytest.mark.slow
def test_quick_start_commands_run(clone: Path) -> None:
    """Every line of the quick start's bash block, the console script run as python -m."""
    block = _blocks("bash")[2]
    for line in block.splitlines():
        args = shlex.split(line)
        assert args[0] == "quark-onnx", line
        done = subprocess.run(
            [sys.executable, "-m", "quark_onnx", *args[1:]],
            cwd=clone,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"


@pytest.mark.slow
def test_python_quick_start_runs(clone: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (block,) = _blocks("python")
    monkeypatch.chdir(clone)
    exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    assert (clone / "digits.xint8.onnx").is_file()
