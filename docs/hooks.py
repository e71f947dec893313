"""mkdocs hooks: mkdocstrings finds the ``conveyor`` package however mkdocs is started.

Started as ``.venv/bin/mkdocs`` (or ``mkdocs serve``), Python puts that script's folder first on ``sys.path``.
griffe, which reads the docstrings for mkdocstrings, searches the path by file name before it imports, and
takes the ``conveyor`` console script in that folder for the package (a package with no modules: "could not
be found"). The sources are in core/ and install as ``conveyor`` (the editable install maps one onto the
other), so only an import finds them: griffe imports once no folder on the path holds the name.
"""

from __future__ import annotations

import sys
from pathlib import Path


def on_startup(command: str, dirty: bool) -> None:
    scripts = Path(sys.argv[0]).resolve().parent
    sys.path[:] = [entry for entry in sys.path if not entry or Path(entry).resolve() != scripts]
