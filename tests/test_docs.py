"""The documentation: a short README that opens with the two commands, a site that builds with
``mkdocs build --strict`` (a broken link, a missing page or a page left out of the nav fails), and a
configuration reference generated from the code, with a doc line for every key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from conveyor.config.reference import CORE_TABLES, reference_markdown, undocumented
from conveyor.registry import PluginRegistry

REPO = Path(__file__).resolve().parent.parent


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    opening = "\n".join(lines[:6])
    assert "make serve" in opening and "make test" in opening


def test_every_config_key_has_a_doc_line():
    registry = PluginRegistry()
    structs = dict(CORE_TABLES)
    for kind in ("scheduler", "kvcache", "quant", "transport"):
        for name in registry.names(kind):
            structs[f"{kind} {name}"] = registry.get(kind, name).Options
    missing = {table: fields for table, struct in structs.items() if (fields := undocumented(struct))}
    assert not missing, f"keys without a comment above them: {missing}"


class _Options(msgspec.Struct):
    # documented
    one: int = 1
    two: int = 2


def test_a_key_without_a_comment_is_found():
    assert undocumented(_Options) == ["two"]


def test_the_configuration_page_is_the_generated_one():
    """docs/configuration.md is what `python -m conveyor.config.reference` writes (`make docs` rewrites it)."""
    assert (REPO / "docs" / "configuration.md").read_text() == reference_markdown()


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            check=False, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "match_prefix" in api and "KVCacheManager" in api  # (the docstrings made it in)
