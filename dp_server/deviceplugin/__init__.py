"""The kubelet's device-plugin API: the plugin sockets and their gRPC service,
Register calls, and the PodResources client."""
