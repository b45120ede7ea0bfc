"""The config file: YAML in, `dp_core.Config` out, and the PCI ID database."""
