"""The README stays true: every option, every preset and the CI test command are in it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.presets import preset_names

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    match = re.search(rf"^## {title}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def test_every_extra_option_is_in_the_options_table() -> None:
    table = _section("Options")
    missing = [f.name for f in dataclasses.fields(ExtraOptions) if f"| `{f.name}` |" not in table]
    assert not missing, f"options missing from the README table: {missing}"


def test_every_preset_is_in_the_presets_table() -> None:
    table = _section("Presets")
    missing = [name for name in preset_names() if f"| `{name}` |" not in table]
    assert not missing, f"presets missing from the README table: {missing}"


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    commands = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert len(commands) >= 2, "the README starts with the install-and-run and the test commands"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] in ci.splitlines()
