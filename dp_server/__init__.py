"""dp_server: the asyncio and grpclib shell around dp_core.

It reads sysfs and /dev into snapshots, serves the kubelet's device plugin API
for every resource from one event loop, and carries out the core's effects.
"""

__all__: list[str] = []
