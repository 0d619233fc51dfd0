#!/usr/bin/env python3
"""Run a chapter's own install line (the `%pip install ...` of its Colab-only setup cell) with this Python.

    python scripts/colab_install.py notebooks/01_memory_anatomy.ipynb
    python scripts/colab_install.py --source . notebooks/01_memory_anatomy.ipynb

Used by `make colab-like`: an environment holding what Colab has preinstalled (constraints/colab.txt) gets
exactly what a Colab reader's first cell installs, then chapters run in the tiny profile. Refuses an install
line that names torch (the book's promise: the setup cell never reinstalls torch). ``--source PATH``
installs the checkout at PATH in place of the repository the line names (``NAME @ git+https://...``), with
the line's own flags: the same resolution against Colab's packages, for the pins of the checkout.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

GIT_REQUIREMENT = re.compile(r"^(?:[\w.-]+\s*@\s*)?git\+https?://\S+$")


def install_line(notebook: Path) -> list[str]:
    """The arguments of the first `%pip install` in the notebook's first code cell."""
    nb = json.loads(notebook.read_text(encoding="utf-8"))
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    for line in "".join(first["source"]).splitlines():
        match = re.match(r"\s*%pip\s+install\s+(.*)$", line)
        if match:
            args = shlex.split(match.group(1))
            if any(re.match(r"torch\b", a) for a in args if not a.startswith("-")):
                raise ValueError(f"{notebook.name}: the install line names torch: {line.strip()}")
            return args
    raise ValueError(f"{notebook.name}: no %pip install line in the first code cell")


def from_source(args: list[str], source: Path) -> list[str]:
    """The install arguments with the repository from GitHub replaced by the checkout at ``source``."""
    replaced = [str(source.resolve()) if GIT_REQUIREMENT.match(a) else a for a in args]
    if replaced == args:
        raise ValueError(f"no git+https requirement to replace in: {shlex.join(args)}")
    return replaced


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, help="install this checkout instead of the repository on GitHub")
    ap.add_argument("notebook", type=Path)
    opts = ap.parse_args(argv)
    args = install_line(opts.notebook)
    if opts.source is not None:
        args = from_source(args, opts.source)
    print("pip install", shlex.join(args), flush=True)
    return subprocess.call([sys.executable, "-m", "pip", "install", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
