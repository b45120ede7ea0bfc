"""Test support for dp, outside the server's packages: the kubelet emulator,
the host topologies and their generator, and hypothesis strategies.

`dp-server demo` uses the emulator and the fixture topology; `strategies`
needs hypothesis, a test dependency, and is imported only by tests."""
