"""The docs cannot drift from the code: the settings reference is the registry, every page is reachable, README
stays the first screen and keeps the line CI runs. (CI builds the site itself with `mkdocs build --strict`.)"""

from __future__ import annotations

import re

import yaml

from accelerate_neuron import settings
from helpers import REPO

DOCS = REPO / "docs"
CI_MARKER = "<!-- ci: test command -->"


def test_the_settings_page_is_the_registry() -> None:
    page = (DOCS / "settings.md").read_text()
    start, end = page.find(settings.TABLE_START), page.find(settings.TABLE_END)
    assert start >= 0 and end > start, "docs/settings.md lost its settings-table markers"
    found = page[start : end + len(settings.TABLE_END)]
    assert found == settings.reference_block(), (
        "docs/settings.md's settings table differs from the registry; replace it with the output of\n"
        "  python -c 'from accelerate_neuron import settings; print(settings.reference_block())'"
    )
    for item in settings.SETTINGS:
        assert f"`{item.env}`" in found
    for key in settings.config_keys():  # and every neuron_config key is a setting of the table
        assert f"`{settings.env_name(key)}`" in found


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    # mkdocs.yml is plain YAML (no !!python tags), so safe_load reads it.
    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(nav) == on_disk, "add the page to mkdocs.yml's nav (or remove the entry)"
    assert len(set(nav)) == len(nav)


def test_readme_is_the_first_screen_and_keeps_the_ci_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move the detail to docs/"
    # .ci/run takes the first line after the marker that is neither a comment nor a fence.
    after = lines[lines.index(CI_MARKER) + 1 :]
    command = next(line for line in after if not line.startswith(("<!--", "```")))
    assert command == "python -m pytest -n 2"
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):  # README's links into the docs point at pages
        assert (REPO / target).is_file(), target
