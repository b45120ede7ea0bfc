"""Moving selected PCI functions to vfio-pci and back: the kernel's rebinding
files, one move at a time, the record of what dp moved (docs/design.md §6),
and their wiring onto the loop (`runtime.BindingRuntime`)."""
