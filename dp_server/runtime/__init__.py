"""The server put together: one `dp_core.Node` on one loop, each sub-system
wired onto it, the host watched and the config followed (`Runtime`)."""
