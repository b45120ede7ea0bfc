"""The host: sysfs and /dev read into a `dp_core.HostSnapshot`, and watched."""
