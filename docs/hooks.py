"""MkDocs hooks (mkdocs.yml `hooks:`): GitHub's heading anchors, and pages kept beside the code.

Heading anchors are made as GitHub makes them, so that a link `page.md#some-heading` works on
GitHub and on the site alike, and `mkdocs build --strict` checks it. Markdown files that live
beside the code (OUTSIDE) are pages of the site too, under the path a page in docs/ links them
by (`../bench/README.md`): the same link works in both places, anchors included.
"""
from __future__ import annotations

import os
import re

from mkdocs.structure.files import File, InclusionLevel

# Path relative to docs/ -> where the page goes in the site.
OUTSIDE = {"../bench/README.md": "bench/index.html"}


def github_slug(text: str, sep: str = "-") -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, each
    space a hyphen (so `a — b` gives `a--b`). Duplicate headings are not given GitHub's `-1`:
    keep headings unique within a page."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", sep)


def on_config(config):
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def on_files(files, config):
    for src, dest in OUTSIDE.items():
        page = File.generated(config, src, inclusion=InclusionLevel.INCLUDED,
                              abs_src_path=os.path.normpath(os.path.join(config.docs_dir, src)))
        page.dest_uri = dest
        files.append(page)
    return files
