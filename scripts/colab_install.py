#!/usr/bin/env python3
"""Run a chapter's own install line (the `%pip install ...` of its Colab-only setup cell) with this Python.

    python scripts/colab_install.py notebooks/01_memory_anatomy.ipynb

Used by `make colab-like`: a clean environment that already has torch, as Colab has, gets exactly what a
Colab reader's first cell installs, then every chapter runs in the tiny profile. Refuses an install line
that names torch (the book's promise: the setup cell never reinstalls torch).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path


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


def main(argv: list[str]) -> int:
    args = install_line(Path(argv[0]))
    print("pip install", shlex.join(args), flush=True)
    return subprocess.call([sys.executable, "-m", "pip", "install", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
