"""The `dp-server` command: scan, serve and demo."""

from dp_server.cli.main import main

__all__ = ["main"]
