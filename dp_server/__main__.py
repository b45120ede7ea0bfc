"""`dp-server` and `python -m dp_server`."""

from __future__ import annotations

import sys

from dp_server.cli import main

if __name__ == "__main__":
    sys.exit(main())
