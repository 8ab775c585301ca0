"""mkdocs hook: the pages in docs/ link to repository files outside docs/ (the benchmark
plots, SECURITY.md, the chart's README) by relative paths, which work where the Markdown is
read in a clone or on the forge. The site has only docs/, so here:

- an image outside docs/ is copied into the site under ``repo/<its path>`` and the link
  points there;
- a link to any other file outside docs/ points at the file on the forge when mkdocs.yml
  has a ``repo_url``, and is otherwise left as its text.

A link to a repository file that does not exist is a warning, so ``mkdocs build --strict``
fails on it as on a broken link between pages.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import File, Files

log = get_plugin_logger(__name__)
REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
IMAGES = (".png", ".svg", ".jpg", ".jpeg", ".gif")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    page_dir = posixpath.dirname(page.file.src_uri)
    out: list[str] = []
    fenced = False
    for line in markdown.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced:
            out.append(line)
            continue

        def rewrite(match: re.Match[str]) -> str:
            target = match["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
                return match[0]
            path, _, anchor = target.partition("#")
            inside = posixpath.normpath(posixpath.join(page_dir, path))
            if not inside.startswith("../"):
                return match[0]  # a page or file of docs/: mkdocs checks it
            in_repo = inside.removeprefix("../")
            if not (REPO / in_repo).exists():
                log.warning("%s links to %s, which the repository lacks", page.file.src_uri, path)
                return match[0]
            if match["bang"] and in_repo.lower().endswith(IMAGES):
                copied = f"repo/{in_repo}"
                if files.get_file_from_path(copied) is None:
                    files.append(File.generated(config, copied, abs_src_path=str(REPO / in_repo)))
                return f"![{match['text']}]({posixpath.relpath(copied, page_dir or '.')})"
            if config.repo_url:
                url = f"{config.repo_url.rstrip('/')}/blob/main/{in_repo}"
                return f"[{match['text']}]({url}{'#' + anchor if anchor else ''})"
            return match["text"]

        out.append(LINK.sub(rewrite, line))
    return "".join(out)
