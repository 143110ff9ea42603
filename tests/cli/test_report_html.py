"""``quantize --report-html``: one self-contained HTML page per model and one per batch, with the
fidelity table, the per-layer error chart and the NPU/CPU partition."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import onnx
import pytest
from cli_helpers import run_cli, tiny_cnn

from quark_onnx.pipeline.report_html import render


class _Page(HTMLParser):
    """The parts of a page the tests read: headings, tables (header cells), SVG titles, links,
    and anything that would load a resource from elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: list[str] = []
        self.tables: list[list[str]] = []
        self.svg_titles: list[str] = []
        self.links: list[str] = []
        self.external: list[str] = []
        self.row_classes: list[str] = []
        self._tag: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        self._tag.append(tag)
        if tag == "table":
            self.tables.append([])
        if tag == "tr":
            self.row_classes.append(values.get("class") or "")
        if tag == "a" and values.get("href"):
            self.links.append(values["href"] or "")
        if tag in ("script", "link", "img", "iframe") or values.get("src"):
            self.external.append(tag)

    def handle_endtag(self, tag: str) -> None:
        while self._tag and self._tag.pop() != tag:
            pass

    def handle_data(self, data: str) -> None:
        if not self._tag:
            return
        tag = self._tag[-1]
        if tag in ("h1", "h2", "h3"):
            self.headings.append(data.strip())
        elif tag == "th" and self.tables:
            self.tables[-1].append(data.strip())
        elif tag == "title" and "svg" in self._tag:
            self.svg_titles.append(data.strip())


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    return page


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("html")
    onnx.save(tiny_cnn(0), folder / "tiny.onnx")
    done = run_cli(
        "quantize", "tiny.onnx", "-o", "out", "--random-calib", "4", "--report-html", cwd=folder
    )
    assert done.returncode == 0, done.stderr
    return folder / "out"


def test_model_page_has_fidelity_table_layer_chart_and_partition(written: Path) -> None:
    text = (written / "tiny.report.html").read_text(encoding="utf-8")
    page = _parse(text)
    for heading in ("Fidelity per output", "Per-layer error", "NPU/CPU partition"):
        assert heading in page.headings
    assert any("faithful" in t and "sqnr_db" in t for t in page.tables), page.tables
    assert "per-layer SQNR, worst first" in page.svg_titles
    assert "NPU/CPU partition" in page.svg_titles
    assert "time per stage" in page.svg_titles and "peak memory per stage" in page.svg_titles
    assert not page.external, "the page loads something from elsewhere"
    # the per-layer chart lists the comparison's layers, worst first
    layers = json.loads((written / "tiny.compare.json").read_text())["layers"]
    assert layers
    svg = text[text.index("per-layer SQNR, worst first") :]
    svg = svg[: svg.index("</svg>")]
    labels = re.findall(r'text-anchor="end">([^<]*)</text>', svg)
    by_name = {e["name"]: e["sqnr_db"] for e in layers}
    assert sorted(labels) == sorted(by_name)
    assert [by_name[n] for n in labels] == sorted(by_name.values())


def test_batch_page_links_every_model_page(written: Path) -> None:
    page = _parse((written / "index.html").read_text(encoding="utf-8"))
    assert page.links == ["tiny.report.html"]
    assert "output SQNR" in page.svg_titles


def test_output_parts_are_rendered_under_their_output() -> None:
    """Per-part fidelity entries (a list ``parts`` under an output) become rows of their own,
    whatever keys they carry."""
    report = {
        "fidelity": {
            "faithful": False,
            "samples": 16,
            "outputs": [
                {
                    "name": "boxes",
                    "sqnr_db": 12.0,
                    "faithful": False,
                    "parts": [
                        {
                            "name": "scores",
                            "kind": "channels 4:5",
                            "sqnr_db": 3.5,
                            "agreement": 0.61,
                            "faithful": False,
                        },
                        {
                            "name": "offsets",
                            "kind": "channels 0:4",
                            "sqnr_db": 20.0,
                            "faithful": True,
                        },
                    ],
                }
            ],
        }
    }
    text = render(report)
    page = _parse(text)
    assert page.row_classes.count("part") == 2
    assert "channels 4:5" in text and "agreement 0.610" in text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="no headless Chromium installed")
def test_page_opens_in_a_headless_browser(written: Path, tmp_path: Path) -> None:
    shot = tmp_path / "page.png"
    done = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
         "--window-size=1200,1600", (written / "tiny.report.html").as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shot.is_file() and shot.stat().st_size > 10_000, done.stderr
