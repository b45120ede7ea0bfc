"""One event loop that feeds a `dp_core.Node` and carries out its effects."""
