"""Finding the command-line tools the test dependencies install."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

__all__ = ["installed_tool"]


def installed_tool(name: str) -> str | None:
    """The path of `name` as installed beside the running interpreter, else on PATH.

    `.venv/bin/python -m pytest` runs without the venv's bin on PATH; its
    tools are next to its interpreter, and the ones there belong to this run.
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    return shutil.which(name)
