"""Moving selected PCI functions to vfio-pci and back: the kernel's rebinding
files, one move at a time, and the record of what dp moved (docs/design.md §6)."""
