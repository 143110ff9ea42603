"""benchmarks/ stays a set of documented tools: every script is in benchmarks/README.md with its
command, and every results file is in results/README.md with the command and commit behind it."""

from __future__ import annotations

from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_every_script_is_documented() -> None:
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    scripts = [p for p in BENCH.rglob("*.py") if ".envs" not in p.parts and ".work" not in p.parts]
    missing = [p.name for p in scripts if p.name not in readme]
    assert not missing, f"scripts missing from benchmarks/README.md: {missing}"
    assert "/work/" not in readme and "/home/" not in readme, "a machine path in the README"


def test_every_results_file_names_its_command_and_commit() -> None:
    index = (BENCH / "results" / "README.md").read_text(encoding="utf-8")
    rows = [line for line in index.splitlines() if line.startswith("| `")]
    for path in (BENCH / "results").iterdir():
        if path.name == "README.md":
            continue
        stem, suffix = path.name.split(".", 1)
        row = [r for r in rows if stem in r.split("|")[1] and suffix in r.split("|")[1]]
        assert row, f"results/{path.name} is not in results/README.md"
        assert "python benchmarks/" in row[0], f"no command for results/{path.name}"
