"""`dp-server` and `python -m dp_server`."""

from __future__ import annotations

import sys


def main() -> int:
    # dp-server talks only over unix sockets and never uses TLS, but asyncio,
    # grpclib and anyio import the ssl module (and OpenSSL) when they can:
    # about 5 MB of resident memory in a server whose budget is 35 MB. Each of
    # them works without it, so the command keeps it unloaded. Library users
    # importing dp_server themselves are not affected.
    if "ssl" not in sys.modules:
        sys.modules["ssl"] = None  # type: ignore[assignment]
    from .cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
