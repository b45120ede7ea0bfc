"""The device-plugin front end in the server: the plugin sockets and their gRPC
service, Register calls, ListAndWatch streams, the kubelet followed and its
checkpoint read, the PodResources client, and their wiring onto the loop
(`runtime.DevicePluginRuntime`)."""
