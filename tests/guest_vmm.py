"""What a VMM does with the VFIO nodes a device plugin hands it, from Python.

Run in the real-kernel guest (tests/test_real_kernel_iommufd.py) by the
scenario drivers, with nothing but the standard library: `fcntl.ioctl` and
`struct`, as QEMU and cloud-hypervisor make the same calls in C.

A container sees only the nodes its runtime made from the plugin's answer
(the Allocate answer's DeviceSpecs, or the CDI spec's deviceNodes): `make_dev`
makes exactly those, as a runtime does (mknod with the host node's type and
numbers at the container path), under a folder of their own. The flows below
open nodes only under that folder, and say which they opened: a node the
plugin did not hand out cannot be used, because it is not there.

The VFIO and iommufd user API, as Linux 6.12 defines it:

- include/uapi/linux/vfio.h: `VFIO_TYPE` is `';'` and `VFIO_BASE` 100; every
  VFIO ioctl is `_IO(VFIO_TYPE, VFIO_BASE + n)` (no size in the number: "the
  structure length (argsz) and flags" travel in the structure itself).
  n = 0 `VFIO_GET_API_VERSION` (returns `VFIO_API_VERSION`, 0);
  1 `VFIO_CHECK_EXTENSION` (an int argument; `VFIO_TYPE1_IOMMU` 1,
  `VFIO_TYPE1v2_IOMMU` 3); 2 `VFIO_SET_IOMMU` (an int); 3
  `VFIO_GROUP_GET_STATUS` (`struct vfio_group_status { __u32 argsz, flags; }`,
  `VFIO_GROUP_FLAGS_VIABLE` 1 << 0, `VFIO_GROUP_FLAGS_CONTAINER_SET` 1 << 1);
  4 `VFIO_GROUP_SET_CONTAINER` (a pointer to the container's fd, `__s32`);
  6 `VFIO_GROUP_GET_DEVICE_FD` (a NUL-terminated device name; returns the
  device's fd); 7 `VFIO_DEVICE_GET_INFO` (`struct vfio_device_info { __u32
  argsz, flags, num_regions, num_irqs, cap_offset, pad; }`,
  `VFIO_DEVICE_FLAGS_RESET` 1 << 0, `VFIO_DEVICE_FLAGS_PCI` 1 << 1); 13
  `VFIO_IOMMU_MAP_DMA` (`struct vfio_iommu_type1_dma_map { __u32 argsz,
  flags; __u64 vaddr, iova, size; }`, `VFIO_DMA_MAP_FLAG_READ` 1 << 0,
  `_WRITE` 1 << 1); 18 `VFIO_DEVICE_BIND_IOMMUFD` (`struct
  vfio_device_bind_iommufd { __u32 argsz, flags; __s32 iommufd; __u32
  out_devid; }`); 19 `VFIO_DEVICE_ATTACH_IOMMUFD_PT` (`struct
  vfio_device_attach_iommufd_pt { __u32 argsz, flags, pt_id; }`, pt_id in:
  an IOAS, out: the hardware page table attached). `VFIO_PCI_NUM_REGIONS` is
  9 (BAR0..5, ROM, CONFIG, VGA) and `VFIO_PCI_NUM_IRQS` 5 (INTX, MSI, MSIX,
  ERR, REQ). Later kernels append fields to the last two structures behind
  argsz; the sizes here are 6.12's, which the kernel takes as the minimum.
- include/uapi/linux/iommufd.h: `IOMMUFD_TYPE` is `';'` too; `IOMMU_*` are
  `_IO(IOMMUFD_TYPE, IOMMUFD_CMD_*)` with `IOMMUFD_CMD_BASE` 0x80:
  `IOMMU_IOAS_ALLOC` 0x81 (`struct iommu_ioas_alloc { __u32 size, flags,
  out_ioas_id; }`), `IOMMU_IOAS_MAP` 0x85 (`struct iommu_ioas_map { __u32
  size, flags, ioas_id, __reserved; __aligned_u64 user_va, length, iova; }`,
  `IOMMU_IOAS_MAP_FIXED_IOVA` 1 << 0, `_WRITEABLE` 1 << 1, `_READABLE` 1 << 2).
- include/uapi/asm-generic/ioctl.h: `_IO(type, nr)` is `(type << 8) | nr`
  (direction none, size 0).
- Documentation/driver-api/vfio.rst: the order of the calls. "VFIO Usage
  Example": open the container, check the API version and the type1
  extension, open the group, check it is viable, set its container, enable
  the IOMMU model, map DMA, get the device's fd, ask its info. "VFIO Device
  cdev", "Device cdev Example": open `/dev/iommu` and the cdev
  (`/dev/vfio/devices/vfioX`); "an opened cdev_fd doesn't give the user any
  permission of accessing the device except binding the cdev_fd to an
  iommufd": `VFIO_DEVICE_BIND_IOMMUFD`, `IOMMU_IOAS_ALLOC`,
  `VFIO_DEVICE_ATTACH_IOMMUFD_PT`, `IOMMU_IOAS_MAP`, then the device is used
  as in the group example.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import mmap
import os
import re
import stat
import struct
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["as_vmm", "cdi_nodes", "group_interface", "iommufd_interface", "make_dev"]


def _io(kind: str, number: int) -> int:
    return (ord(kind) << 8) | number  # asm-generic/ioctl.h: _IO(type, nr)


VFIO_TYPE, VFIO_BASE = ";", 100
VFIO_API_VERSION = 0
VFIO_TYPE1_IOMMU, VFIO_TYPE1v2_IOMMU = 1, 3
VFIO_GET_API_VERSION = _io(VFIO_TYPE, VFIO_BASE + 0)
VFIO_CHECK_EXTENSION = _io(VFIO_TYPE, VFIO_BASE + 1)
VFIO_SET_IOMMU = _io(VFIO_TYPE, VFIO_BASE + 2)
VFIO_GROUP_GET_STATUS = _io(VFIO_TYPE, VFIO_BASE + 3)
VFIO_GROUP_SET_CONTAINER = _io(VFIO_TYPE, VFIO_BASE + 4)
VFIO_GROUP_GET_DEVICE_FD = _io(VFIO_TYPE, VFIO_BASE + 6)
VFIO_DEVICE_GET_INFO = _io(VFIO_TYPE, VFIO_BASE + 7)
VFIO_IOMMU_MAP_DMA = _io(VFIO_TYPE, VFIO_BASE + 13)
VFIO_DEVICE_BIND_IOMMUFD = _io(VFIO_TYPE, VFIO_BASE + 18)
VFIO_DEVICE_ATTACH_IOMMUFD_PT = _io(VFIO_TYPE, VFIO_BASE + 19)
VFIO_GROUP_FLAGS_VIABLE, VFIO_GROUP_FLAGS_CONTAINER_SET = 1 << 0, 1 << 1
VFIO_DEVICE_FLAGS_RESET, VFIO_DEVICE_FLAGS_PCI = 1 << 0, 1 << 1
VFIO_DMA_MAP_FLAG_READ, VFIO_DMA_MAP_FLAG_WRITE = 1 << 0, 1 << 1
VFIO_PCI_NUM_REGIONS, VFIO_PCI_NUM_IRQS = 9, 5

IOMMUFD_TYPE, IOMMUFD_CMD_BASE = ";", 0x80
IOMMU_IOAS_ALLOC = _io(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 1)
IOMMU_IOAS_MAP = _io(IOMMUFD_TYPE, IOMMUFD_CMD_BASE + 5)
IOMMU_IOAS_MAP_FIXED_IOVA, IOMMU_IOAS_MAP_WRITEABLE, IOMMU_IOAS_MAP_READABLE = 1, 2, 4

# struct layouts (native byte order, as the kernel reads them)
GROUP_STATUS = struct.Struct("=II")  # argsz, flags
DEVICE_INFO = struct.Struct("=IIIIII")  # argsz, flags, num_regions, num_irqs, cap_offset, pad
DMA_MAP = struct.Struct("=IIQQQ")  # argsz, flags, vaddr, iova, size
BIND_IOMMUFD = struct.Struct("=IIiI")  # argsz, flags, iommufd, out_devid
ATTACH_PT = struct.Struct("=III")  # argsz, flags, pt_id
IOAS_ALLOC = struct.Struct("=III")  # size, flags, out_ioas_id
IOAS_MAP = struct.Struct("=IIIIQQQ")  # size, flags, ioas_id, __reserved, user_va, length, iova

GROUP_NODE = re.compile(r"^/dev/vfio/[0-9]+$")
_MAPPED = 1 << 20  # the "guest memory" a VMM maps for the device's DMA
_IOVA = 0x100000


def make_dev(root: str, nodes: Iterable[tuple[str, str]]) -> list[str]:
    """Make each (container path, host path) node under `root` as a container
    runtime does, from the host node's type and numbers; the container paths."""
    made = []
    for container_path, host_path in nodes:
        info = os.stat(host_path)
        if not stat.S_ISCHR(info.st_mode):
            raise ValueError(f"{host_path} is not a character device")
        target = root + container_path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.mknod(target, stat.S_IFCHR | 0o600, info.st_rdev)
        made.append(container_path)
    return made


class _Opener:
    """Opens container paths under `root` only, and remembers which."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.opened: list[str] = []
        self._fds: list[int] = []

    def open(self, container_path: str) -> int:
        fd = os.open(self.root + container_path, os.O_RDWR | os.O_CLOEXEC)
        self.opened.append(container_path)
        return self.keep(fd)

    def keep(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    def close(self) -> None:
        for fd in reversed(self._fds):
            os.close(fd)
        self._fds.clear()


def _call(step: str, steps: dict[str, Any], fd: int, request: int, arg: Any) -> Any:
    try:
        result = (
            fcntl.ioctl(fd, request, arg, True)
            if isinstance(arg, bytearray)
            else (fcntl.ioctl(fd, request, arg))
        )
    except OSError as error:
        steps[step] = f"{errno.errorcode.get(error.errno, error.errno)}: {error.strerror}"
        raise
    return result


def _device_info(steps: dict[str, Any], device: int) -> None:
    info = bytearray(DEVICE_INFO.pack(DEVICE_INFO.size, 0, 0, 0, 0, 0))
    _call("VFIO_DEVICE_GET_INFO", steps, device, VFIO_DEVICE_GET_INFO, info)
    _, flags, regions, irqs, _, _ = DEVICE_INFO.unpack(info)
    steps["VFIO_DEVICE_GET_INFO"] = {
        "pci": bool(flags & VFIO_DEVICE_FLAGS_PCI),
        "reset": bool(flags & VFIO_DEVICE_FLAGS_RESET),
        "num_regions": regions,
        "num_irqs": irqs,
    }


def _guest_memory() -> tuple[mmap.mmap, int]:
    memory = mmap.mmap(-1, _MAPPED, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory[:8] = b"dp-guest"  # touched, as guest RAM is
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    return memory, address


@contextlib.contextmanager
def _attempt(root: str) -> Iterator[tuple[dict[str, Any], _Opener, int]]:
    """One VMM's attempt: the steps it records, what opens the container's
    nodes, and the address of its guest memory. The steps say at the end
    whether it got through ("ok": an ioctl that failed says which, in its
    step) and which nodes it opened; everything it opened is closed."""
    steps: dict[str, Any] = {}
    opener = _Opener(root)
    memory, address = _guest_memory()
    try:
        yield steps, opener, address
        steps["ok"] = True
    except OSError:
        steps["ok"] = False
    finally:
        opener.close()
        memory.close()
    steps["opened"] = opener.opened


def group_interface(root: str, container: str, group: str, device_name: str) -> dict[str, Any]:
    """vfio.rst's "VFIO Usage Example" on the container's `container` and
    `group` nodes, for the device `device_name` (a PCI address or mdev UUID).

    Returns what each step gave (an errno name where one failed) and which
    nodes were opened.
    """
    with _attempt(root) as (steps, opener, address):
        fd = opener.open(container)
        steps["VFIO_GET_API_VERSION"] = _call(
            "VFIO_GET_API_VERSION", steps, fd, VFIO_GET_API_VERSION, 0
        )
        steps["VFIO_CHECK_EXTENSION(TYPE1)"] = _call(
            "VFIO_CHECK_EXTENSION(TYPE1)", steps, fd, VFIO_CHECK_EXTENSION, VFIO_TYPE1_IOMMU
        )
        group_fd = opener.open(group)
        status = bytearray(GROUP_STATUS.pack(GROUP_STATUS.size, 0))
        _call("VFIO_GROUP_GET_STATUS", steps, group_fd, VFIO_GROUP_GET_STATUS, status)
        steps["VFIO_GROUP_GET_STATUS"] = {
            "viable": bool(GROUP_STATUS.unpack(status)[1] & VFIO_GROUP_FLAGS_VIABLE)
        }
        _call(
            "VFIO_GROUP_SET_CONTAINER",
            steps,
            group_fd,
            VFIO_GROUP_SET_CONTAINER,
            struct.pack("=i", fd),
        )
        steps["VFIO_GROUP_SET_CONTAINER"] = "ok"
        _call("VFIO_SET_IOMMU", steps, fd, VFIO_SET_IOMMU, VFIO_TYPE1_IOMMU)
        steps["VFIO_SET_IOMMU(TYPE1)"] = "ok"
        dma = bytearray(
            DMA_MAP.pack(
                DMA_MAP.size,
                VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
                address,
                _IOVA,
                _MAPPED,
            )
        )
        _call("VFIO_IOMMU_MAP_DMA", steps, fd, VFIO_IOMMU_MAP_DMA, dma)
        steps["VFIO_IOMMU_MAP_DMA"] = "ok"
        name = bytearray(device_name.encode() + b"\0")
        device = opener.keep(
            _call("VFIO_GROUP_GET_DEVICE_FD", steps, group_fd, VFIO_GROUP_GET_DEVICE_FD, name)
        )
        steps["VFIO_GROUP_GET_DEVICE_FD"] = "ok"
        _device_info(steps, device)
    return steps


def iommufd_interface(root: str, cdev: str, iommu: str | int) -> dict[str, Any]:
    """vfio.rst's "Device cdev Example" on the container's `cdev` node.

    `iommu` is the container's `/dev/iommu` node, or a descriptor of it opened
    elsewhere: KubeVirt's `devices.kubevirt.io/iommufd` plugin opens
    `/dev/iommu` and passes the descriptor to virt-launcher, while the device
    plugin (`group+cdev`) hands out only the cdev.
    """
    with _attempt(root) as (steps, opener, address):
        iommufd = opener.open(iommu) if isinstance(iommu, str) else iommu
        steps["iommufd"] = iommu if isinstance(iommu, str) else "passed as a descriptor"
        device = opener.open(cdev)
        bind = bytearray(BIND_IOMMUFD.pack(BIND_IOMMUFD.size, 0, iommufd, 0))
        _call("VFIO_DEVICE_BIND_IOMMUFD", steps, device, VFIO_DEVICE_BIND_IOMMUFD, bind)
        steps["VFIO_DEVICE_BIND_IOMMUFD"] = {"out_devid": BIND_IOMMUFD.unpack(bind)[3]}
        ioas = bytearray(IOAS_ALLOC.pack(IOAS_ALLOC.size, 0, 0))
        _call("IOMMU_IOAS_ALLOC", steps, iommufd, IOMMU_IOAS_ALLOC, ioas)
        ioas_id = IOAS_ALLOC.unpack(ioas)[2]
        steps["IOMMU_IOAS_ALLOC"] = {"out_ioas_id": ioas_id}
        attach = bytearray(ATTACH_PT.pack(ATTACH_PT.size, 0, ioas_id))
        _call("VFIO_DEVICE_ATTACH_IOMMUFD_PT", steps, device, VFIO_DEVICE_ATTACH_IOMMUFD_PT, attach)
        steps["VFIO_DEVICE_ATTACH_IOMMUFD_PT"] = {"pt_id": ATTACH_PT.unpack(attach)[2]}
        flags = IOMMU_IOAS_MAP_FIXED_IOVA | IOMMU_IOAS_MAP_WRITEABLE | IOMMU_IOAS_MAP_READABLE
        mapping = bytearray(
            IOAS_MAP.pack(IOAS_MAP.size, flags, ioas_id, 0, address, _MAPPED, _IOVA)
        )
        _call("IOMMU_IOAS_MAP", steps, iommufd, IOMMU_IOAS_MAP, mapping)
        steps["IOMMU_IOAS_MAP"] = "ok"
        _device_info(steps, device)
    return steps


def cdi_nodes(cdi_dir: Path, names: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """The device nodes and env the container gets from the CDI devices `names`."""
    import cdi_reader  # tests/cdi_reader.py, beside this file in the guest

    # The specs of the kinds asked for (another spec, such as a DRA claim's
    # metadata with its mounts, is no business of a VMM's).
    kinds = {name.partition("=")[0] for name in names}
    specs = [
        cdi_reader.read_spec(path.read_bytes(), str(path))
        for path in sorted(Path(cdi_dir).glob("*.json"))
        if json.loads(path.read_bytes()).get("kind") in kinds
    ]
    nodes: list[tuple[str, str]] = []
    env: list[str] = []
    for name in names:
        edits = cdi_reader.resolve(specs, name)
        for node in edits.device_nodes:
            if (node.path, node.host_path) not in nodes:
                nodes.append((node.path, node.host_path))
        env += [e for e in edits.env if e not in env]
    return nodes, env


def as_vmm(nodes: list[tuple[str, str]], device: str) -> dict[str, Any]:
    """Make the container's /dev from `nodes`, as a runtime does, and drive
    each VFIO interface they allow for `device` (a PCI address or mdev UUID)."""
    root = tempfile.mkdtemp(prefix="ctr-", dir="/tmp")
    made = make_dev(root, nodes)
    done: dict[str, Any] = {"nodes": made}
    group = next((p for p in made if GROUP_NODE.match(p)), None)
    cdev = next((p for p in made if p.startswith("/dev/vfio/devices/")), None)
    if group is not None and "/dev/vfio/vfio" in made:
        done["group"] = group_interface(root, "/dev/vfio/vfio", group, device)
    if cdev is not None:
        if "/dev/iommu" in made:
            done["iommufd"] = iommufd_interface(root, cdev, "/dev/iommu")
        else:
            # group+cdev: KubeVirt's devices.kubevirt.io/iommufd plugin opens
            # /dev/iommu outside the container and passes the descriptor.
            passed = os.open("/dev/iommu", os.O_RDWR | os.O_CLOEXEC)
            try:
                done["iommufd"] = iommufd_interface(root, cdev, passed)
            finally:
                os.close(passed)
    return done
