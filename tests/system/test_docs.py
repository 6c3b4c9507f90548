"""The documentation site (mkdocs.yml, docs/): it builds with warnings as errors, its internal links and
anchors resolve, every notebook has a page with its pictures, the API page documents every public name, and
every page's Python blocks run as written.

The build runs in .venv-docs, which holds only the ``docs`` extra of pyproject.toml; ``bash scripts/docs.sh
venv`` makes it. A missing .venv-docs is a failure that says so, not a skip.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MKDOCS = ROOT / ".venv-docs" / "bin" / "mkdocs"
BUILD_TIMEOUT_S = 240
#: Pages whose Python blocks run (every docs page with a ```python block is listed by the test below).
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def python_blocks(text: str) -> list:
    return PYTHON_BLOCK.findall(text)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built strictly into a temporary folder (mkdocs' own --strict: any warning fails)."""
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} is missing: make the docs venv with `bash scripts/docs.sh venv` "
                    "(it installs the `docs` extra of pyproject.toml), then run this test again")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=BUILD_TIMEOUT_S, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return out


class _Links(HTMLParser):
    """The ids a page defines and the links (href / src) it holds."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("id", "name"):
            if attrs.get(key):
                self.ids.add(attrs[key])
        for key in ("href", "src"):
            if attrs.get(key) is not None and not (tag == "a" and key == "src"):
                self.links.append(attrs[key])


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _internal(link: str) -> bool:
    parts = urlsplit(link)
    return not (parts.scheme or parts.netloc or link.startswith(("data:", "mailto:", "javascript:")))


def _target(page: Path, link: str, site: Path) -> tuple:
    """The file and fragment a link names (a path from "/" is from the site's root, as 404.html writes them)."""
    parts = urlsplit(link)
    base = site if parts.path.startswith("/") else page.parent
    path = page if not parts.path else (base / unquote(parts.path).lstrip("/")).resolve()
    if path.is_dir():
        path = path / "index.html"
    return path, unquote(parts.fragment)


def broken_links(site: Path) -> tuple:
    """``(links checked, broken ones)``: every internal href / src of the site's pages must name a file, and a
    fragment an id of that page."""
    parsed = {p.resolve(): _parse(p) for p in sorted(site.rglob("*.html"))}
    broken, checked = [], 0
    for page, found in parsed.items():
        for link in found.links:
            if not _internal(link):
                continue
            target, fragment = _target(page, link, site)
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link} (no file {target})")
            elif fragment and target.suffix == ".html" and fragment not in parsed[target.resolve()].ids:
                broken.append(f"{page.relative_to(site)}: {link} (no id {fragment!r} in {target.name})")
    return checked, broken


def test_link_check_finds_a_missing_page_and_a_missing_anchor(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "index.html").write_text('<h2 id="top">t</h2><a href="sub/a.html#here">ok</a>'
                                         '<a href="sub/a.html#gone">bad anchor</a><a href="nowhere.html">bad page</a>'
                                         '<a href="https://example.org/x.html">external</a><a href="#top">self</a>')
    (tmp_path / "sub" / "a.html").write_text('<p id="here">a</p><img src="../index.html"><a href="/index.html#top">')
    checked, broken = broken_links(tmp_path)
    assert checked == 6
    assert broken == ["index.html: sub/a.html#gone (no id 'gone' in a.html)",
                      f"index.html: nowhere.html (no file {tmp_path.resolve() / 'nowhere.html'})"]


def test_site_links_and_anchors_resolve(site):
    assert len(list(site.rglob("*.html"))) > 20
    checked, broken = broken_links(site)
    assert checked > 500, checked
    assert not broken, "broken internal links:\n" + "\n".join(broken[:50])


def test_every_notebook_has_a_page_with_its_pictures(site):
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) >= 7
    nav = (ROOT / "mkdocs.yml").read_text()
    for nb in notebooks:
        assert (DOCS / "notebooks" / nb.name).resolve() == nb.resolve(), \
            f"docs/notebooks/{nb.name} must link to notebooks/{nb.name} (ln -s ../../notebooks/{nb.name} docs/notebooks/)"
        assert f"notebooks/{nb.name}" in nav, f"mkdocs.yml's nav has no entry for notebooks/{nb.name}"
        cells = json.loads(nb.read_text())["cells"]
        pictures = sum("image/png" in out.get("data", {}) for cell in cells for out in cell.get("outputs", []))
        html = (site / "notebooks" / nb.with_suffix(".html").name).read_text(encoding="utf-8")
        first_source = "".join(next(c for c in cells if c["cell_type"] == "code")["source"]).splitlines()[0]
        assert html.count("data:image/png") >= pictures, (nb.name, pictures)
        assert re.sub(r"\W+", "", first_source)[:20] in re.sub(r"<[^>]+>|\W+", "", html), nb.name


def test_api_page_documents_every_public_name(site):
    import snn_explorer

    html = (site / "api.html").read_text(encoding="utf-8")
    documented = {m.rsplit(".", 1)[1] for m in re.findall(r'id="(snn_explorer\.\w+\.\w+)"', html)}
    missing = sorted(set(snn_explorer.__all__) - documented)
    assert len(snn_explorer.__all__) > 40
    assert not missing, f"docs/api.md has no ::: entry for {missing}"


def test_readme_links_point_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if _internal(link)]
    assert len(local) >= 8, local
    missing = [link for link in local if not (ROOT / unquote(urlsplit(link).path)).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    assert len(readme.encode()) <= 12 * 1024, f"README.md is {len(readme.encode())} bytes; the limit is 12 KiB"


def _pages_with_code() -> list:
    return sorted(p for p in DOCS.rglob("*.md") if python_blocks(p.read_text()))


def test_pages_with_python_blocks_are_the_expected_ones():
    """A page losing its examples (or a fence typo hiding them) shows here."""
    pages = {str(p.relative_to(DOCS)) for p in _pages_with_code()}
    assert {"getting-started.md", "byom.md", "guides/planning.md", "guides/checkpoints.md",
            "guides/memory-levers.md", "guides/fitting-a-budget.md", "concepts/parallelism.md"} <= pages, pages


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", _pages_with_code(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_python_blocks_run_as_written(page, tmp_path):
    """A page's Python blocks, in order, in one fresh interpreter (step times on a datasheet profile, so
    that no block calibrates this machine)."""
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(python_blocks(page.read_text())) + "\nprint('PAGE OK')\n")
    env = {**os.environ, "MPLBACKEND": "Agg", "SNN_EXPLORER_PROGRESS": "0",
           "SNN_EXPLORER_HARDWARE": os.environ.get("SNN_EXPLORER_HARDWARE", "A100-SXM-80GB"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=580,
                          env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.rstrip().endswith("PAGE OK")
