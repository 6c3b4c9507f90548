"""mkdocs hooks of the documentation site (mkdocs.yml's ``hooks``).

mkdocs-jupyter builds a notebook page's table of contents with anchors of its own slugging, which drops a
heading's code spans (``## 1 · `register_stateful` `` -> ``#1``), while the page's headings keep them
(``id="1-register_stateful"``). The table of contents is pointed at the headings' real ids, matched in order and
by level, so its links land.
"""
from __future__ import annotations

import re

_HEADING = re.compile(r'<h([1-6])[^>]*\bid="([^"]+)"')


def _items(toc):
    for item in toc:
        yield item
        yield from _items(item.children)


def on_page_content(html, page, config, files):
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    headings = [(int(level), anchor) for level, anchor in _HEADING.findall(html)]
    ids = {anchor for _, anchor in headings}
    position = 0
    for item in _items(page.toc):
        if item.id in ids:
            position = next((i + 1 for i, (_, anchor) in enumerate(headings) if anchor == item.id), position)
            continue
        for i in range(position, len(headings)):
            if headings[i][0] == item.level:
                item.id, position = headings[i][1], i + 1
                break
    return html
