"""Every preset writes byte-identical models before and after a refactor.

The sha256 list is ``tests/data/output_hashes.json``, written by ``benchmarks/output_hashes.py
--write`` (run it after a change that is meant to change outputs, and say why in the commit).
Tiny seeded graphs run by default; the shared real models are ``real_model``/``slow``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import output_hashes as oh
from conftest import shared_path

CASES = oh.cases()
STORED = oh.load_hashes()


def _param(case: oh.Case):
    marks = () if case.fast else (pytest.mark.real_model, pytest.mark.slow)
    return pytest.param(case, id=case.name, marks=marks)


def test_every_case_has_a_stored_hash_and_none_is_stale():
    names = {c.name for c in CASES}
    assert sorted(names - set(STORED)) == []
    assert sorted(set(STORED) - names) == []


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_output_is_byte_identical(case: oh.Case):
    for need in case.needs:
        shared_path(*need.split("/"))
    digest = oh.run_case(case)
    assert digest == STORED[case.name], (
        f"{case.name}: the written model changed; if intended, regenerate with "
        "`python benchmarks/output_hashes.py --write` and say why in the commit"
    )
