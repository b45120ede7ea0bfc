"""`dp-server` and `python -m dp_server`."""

from __future__ import annotations

import os
import sys
import types


def lean_imports() -> None:
    """Keep modules the command never needs out of its memory.

    - dp-server talks only over unix sockets and never uses TLS, but asyncio and
      grpclib import the ssl module (and OpenSSL) when they can: about 5 MB of
      resident memory in a server whose budget is 35 MB. Both work without it.
    - betterproto2 asks importlib.metadata for its own version when imported,
      to check it against the compiler that generated our messages. That one
      lookup loads importlib.metadata with email, zipfile, csv and friends:
      2.3 MB. The installed distribution's directory name gives the same
      version, so the lookup is answered from it and the check still runs.
    - betterproto2 also imports pydantic, and with it pydantic-core's 5 MB
      library, whenever pydantic is installed (as on many a host Python), to
      validate pydantic-dataclass messages; dp's generated messages are plain.
      A serving dp held 41-44 MB with it, 34 MB without. pydantic is hidden
      from that one import only: whatever imports it later gets it.
    - watchfiles' package imports its process runner, and with it
      multiprocessing and pickle (0.2 MB); dp uses only `watch`. The runner is
      replaced by one that says so if it is ever called.

    Library users importing dp_server themselves are not affected.
    """
    if "ssl" not in sys.modules:
        sys.modules["ssl"] = None  # type: ignore[assignment]
    if "watchfiles" not in sys.modules and "watchfiles.run" not in sys.modules:
        runner = types.ModuleType("watchfiles.run")
        # Any name a watchfiles release imports from it: the runner says it is absent.
        runner.__getattr__ = lambda name: _no_process_runner  # type: ignore[method-assign]
        sys.modules["watchfiles.run"] = runner
    if "betterproto2" in sys.modules:
        return
    hidden: dict[str, types.ModuleType | None] = {}
    if "pydantic" not in sys.modules:
        hidden["pydantic"] = None
    if "importlib.metadata" not in sys.modules:
        version = _installed_version("betterproto2")
        if version is not None:  # else an unusual install: betterproto2 looks it up itself
            lookup = types.ModuleType("importlib.metadata")
            lookup.version = lambda name: version if name == "betterproto2" else None  # type: ignore[attr-defined]
            hidden["importlib.metadata"] = lookup
    sys.modules.update(hidden)  # type: ignore[arg-type]  # None makes an import fail
    try:
        import betterproto2  # noqa: F401
    finally:
        for name in hidden:
            del sys.modules[name]


def _no_process_runner(*args: object, **kwargs: object) -> None:
    raise RuntimeError("watchfiles' process runner is not loaded in dp-server")


def _installed_version(distribution: str) -> str | None:
    """The version in `<distribution>-<version>.dist-info` on sys.path, if any."""
    prefix, suffix = f"{distribution}-", ".dist-info"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.startswith(prefix) and name.endswith(suffix):
                return name[len(prefix) : -len(suffix)]
    return None


def main() -> int:
    lean_imports()
    from .cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
