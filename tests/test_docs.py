"""The README stays a short front door and the documentation site stays whole: the README's
links reach their pages and headings, every page is in the site's navigation, the site builds
in strict mode (a broken link or anchor fails), the recipes shown parse, the README's training
lines are lines of the tested script, and no dated measurement sits in the prose (those live in
bench/README.md). A few seconds; no network."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from doc_scripts import PAGE, doc_script

from mpitailor.planning.recipe import parse_recipe

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MAX_README_LINES = 150
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _slug():
    """docs/hooks.py's github_slug: the anchors mkdocs makes, which are GitHub's."""
    spec = importlib.util.spec_from_file_location("doc_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks.github_slug


def _anchors(page: Path) -> set[str]:
    slug, text = _slug(), FENCE.sub("", page.read_text())
    return {slug(re.sub(r"[`*]", "", m.group(1)))
            for m in re.finditer(r"^#{1,6} +(.+?) *$", text, re.M)}


def _prose(path: Path) -> str:
    """The text outside code blocks."""
    return FENCE.sub("", path.read_text())


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}): "
                                   f"move the detail to a page in docs/")


def test_the_readme_links_reach_their_pages_and_headings():
    for target in LINK.findall(_prose(README)):
        if re.match(r"[a-z]+:", target):
            continue  # an external link: not checked offline
        path, _, anchor = target.partition("#")
        page = (README.parent / path).resolve() if path else README
        assert page.exists(), f"README.md links {target}: no such file"
        if anchor:
            assert anchor in _anchors(page), f"README.md links {target}: no such heading"


def test_every_page_is_in_the_site_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def paths(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from paths(value) if isinstance(value, list) else (value,)
    in_nav = set(paths(config["nav"]))
    assert {p.name for p in PAGES} <= in_nav, "a page of docs/ is missing from mkdocs.yml's nav"
    assert all((DOCS / p).resolve().exists() for p in in_nav)


def test_the_site_builds_in_strict_mode_and_works_from_disk(tmp_path):
    """Built strict; and opened from disk (file://, no server: D3 of issue 41) every link of
    every page reaches a file, not a directory listing."""
    site = ROOT / os.environ.get("MPITAILOR_SITE_BUILT", "")
    if os.environ.get("MPITAILOR_SITE_BUILT"):  # `make test`: its `make docs` built it
        assert (site / "index.html").is_file(), f"make docs built no site in {site}"
    else:
        pytest.importorskip("mkdocs")
        site = tmp_path / "site"
        run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                              "--site-dir", str(site)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
    pages = sorted(p for p in site.rglob("*.html") if p.name != "404.html")  # served only
    assert len(pages) > 10, pages
    for page in pages:
        for target in re.findall(r'(?:href|src)="([^"#?]+)', page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # mailto:, https: (none is fetched when a page is viewed)
            where = (page.parent / target).resolve()
            assert where.is_file(), f"{page.relative_to(site)} links {target}: " \
                f"{'a directory' if where.is_dir() else 'no such file'} from disk"


def test_the_recipes_shown_parse():
    shown = [(p, block) for p in (README, *PAGES)
             for lang, block in FENCE.findall(p.read_text()) if lang == "yaml"]
    assert len(shown) >= 4
    for path, block in shown:
        parse_recipe(block, origin=str(path), base_dir=ROOT)  # UserError if not a recipe


def test_the_readme_training_lines_are_those_of_the_tested_script():
    script = doc_script("deepspeed-example").splitlines()
    readme = [block for lang, block in FENCE.findall(README.read_text()) if lang == "python"]
    assert len(readme) == 1
    lines = [line for line in readme[0].splitlines() if line.strip() not in ("", "...")]
    missing = [line for line in lines if line not in script]
    assert not missing, f"README.md's training lines are not in {PAGE.name}'s script: {missing}"


def test_no_dated_measurement_in_the_prose():
    for path in (README, *PAGES):
        dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", _prose(path))
        assert not dates, (f"{path.name} dates {dates}: a dated measurement goes to "
                           f"bench/README.md, with its machine and commit")
