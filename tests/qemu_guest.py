"""A real Linux kernel under QEMU, with an emulated Intel IOMMU, to run dp in.

Two kinds of kernel are booted. Debian's (the cloud flavour, or another such
as the generic one), fetched with `apt-get download` and unpacked, never
installed, whose `/init` loads the virtio and VFIO modules: Linux 6.1 without
iommufd, the "kernel without VFIO character devices" case. And a kernel with
iommufd, VFIO character devices and the kernel's sample mdev drivers, all
built in (`iommufd_kernel`): `../shared/kernels/linux-6.12-iommufd` beside the
checkout (as CI has it), or $DP_TEST_KERNEL_DIR, or built by
scripts/build-test-kernel.sh. See ../shared/qemu-notes.md for what was tried.
The tools are Debian's: `qemu-system-x86`, `kmod`, `cpio`, `busybox-static`,
`e2fsprogs`.

The guest boots from an initramfs whose busybox `/init` runs the scenario's
steps: pieces of shell run as root (the operator's part, such as binding
devices to vfio-pci), in which `py` runs Debian's python3.11 chrooted into a
read-only ext4 image that holds it, its standard library and dp with its
dependencies (`python_image`, made once per test run). Each step's output
comes back over the serial console between markers. Only the console of the
last boot is kept, in `<workdir>/console.txt`; the initramfs is removed.

`/dev/kvm` here cannot run QEMU's CPU models, so the guest is emulated (TCG).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = "qemu-system-x86 kmod cpio busybox-static e2fsprogs"
KERNEL_PACKAGE = "linux-image-cloud-amd64"
MODULES = ("virtio_pci", "virtio_blk", "vfio-pci", "vfio_iommu_type1")
PYTHON = Path("/usr/bin/python3.11")  # Debian's: its stdlib is /usr/lib/python3.11
MARK = "=== dp-guest"
# DP_GUEST_APPEND replaces them, e.g. without `quiet` to see the boot.
# no_timer_check: under TCG on a loaded host the kernel's check that the timer
# interrupt works through the interrupt-remapped IO-APIC can time out, and
# with the IOMMU's interrupt remapping on it panics ("timer doesn't work
# through Interrupt-remapped IO-APIC") instead of falling back.
KERNEL_ARGUMENTS = "console=ttyS0 intel_iommu=on iommu=pt panic=-1 quiet loglevel=1 no_timer_check"
PROJECT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = PROJECT / "scripts" / "build-test-kernel.sh"
KERNEL_DIR_VARIABLE = "DP_TEST_KERNEL_DIR"
_TOOLS = ("qemu-system-x86_64", "busybox", "cpio", "mke2fs", "depmod", "modprobe", "apt-get")
_STDLIB_SKIPPED = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}

__all__ = [
    "KERNEL_DIR_VARIABLE",
    "PACKAGES",
    "Guest",
    "Kernel",
    "debian_kernel",
    "disk",
    "iommufd_kernel",
    "iommufd_kernel_dir",
    "missing",
    "python_image",
    "require",
]


def missing() -> str | None:
    """Why a guest cannot be booted here, or None if it can."""
    for tool in _TOOLS:
        if shutil.which(tool) is None:
            return f"no `{tool}` (apt-get install {PACKAGES})"
    if not PYTHON.exists():
        return f"no {PYTHON} (Debian's python3.11)"
    busybox = shutil.which("busybox") or "busybox"
    linked = subprocess.run(["ldd", busybox], capture_output=True, text=True, check=False)
    if linked.returncode == 0:  # the initramfs has no C library for it
        return f"{busybox} is dynamically linked (apt-get install busybox-static)"
    return None


def require() -> None:
    """Skip the test (or with DP_REQUIRE_QEMU=1, as CI sets, fail it) where no
    guest can be booted."""
    import pytest

    why = missing()
    if why is not None:
        if os.environ.get("DP_REQUIRE_QEMU") == "1":
            pytest.fail(f"DP_REQUIRE_QEMU=1 but no guest can be booted: {why}")
        pytest.skip(why)


def _run(*command: str | Path, **kwargs: object) -> str:
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, check=False, **kwargs
    )
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel to boot: its image and, for a modular one, the modules `/init` loads."""

    vmlinuz: Path
    modules_dir: Path | None = None
    version: str | None = None
    modules: tuple[str, ...] = ()

    def module_files(self) -> list[Path]:
        """The modules' files in load order, each after what it needs."""
        if self.modules_dir is None or self.version is None:
            return []
        ordered: list[Path] = []
        for module in self.modules:
            shown = _run(
                "modprobe", "-d", self.modules_dir, "-S", self.version, "--show-depends", module
            )
            for line in shown.splitlines():
                if line.startswith("insmod "):
                    path = Path(line.split()[1])
                    if path not in ordered:
                        ordered.append(path)
        return ordered


def debian_kernel(
    directory: Path, meta_package: str = KERNEL_PACKAGE, modules: tuple[str, ...] = MODULES
) -> Kernel:
    """The kernel behind a Debian meta-package, downloaded and unpacked (not
    installed) into `directory`; `/init` loads `modules` and what they need."""
    directory.mkdir(parents=True, exist_ok=True)
    depends = _run("apt-cache", "depends", meta_package)
    package = next(
        line.split(":", 1)[1].strip()
        for line in depends.splitlines()
        if line.strip().startswith("Depends: linux-image-")
    )
    _run("apt-get", "download", package, cwd=directory)
    (deb,) = directory.glob(f"{package}_*.deb")
    _run("dpkg", "-x", deb, directory / "root")
    deb.unlink()
    (vmlinuz,) = (directory / "root" / "boot").glob("vmlinuz-*")
    version = vmlinuz.name.removeprefix("vmlinuz-")
    _run("depmod", "-b", directory / "root", version)
    return Kernel(vmlinuz, directory / "root", version, modules)


def iommufd_kernel_dir() -> Path:
    """Where the kernel with iommufd is looked for: $DP_TEST_KERNEL_DIR, or
    `../shared/kernels/linux-6.12-iommufd` beside the checkout (as CI has it)."""
    default = PROJECT.parent / "shared" / "kernels" / "linux-6.12-iommufd"
    return Path(os.environ.get(KERNEL_DIR_VARIABLE) or default)


def iommufd_kernel() -> Kernel | str:
    """The kernel with iommufd, VFIO character devices and sample mdev drivers
    (everything built in), or why there is none.

    With DP_BUILD_TEST_KERNEL=1 a missing one is built into the directory by
    scripts/build-test-kernel.sh first (about 11 minutes on 2 CPUs).
    """
    directory = iommufd_kernel_dir()
    bzimage = directory / "bzImage"
    if not bzimage.is_file() and os.environ.get("DP_BUILD_TEST_KERNEL") == "1":
        subprocess.run([str(BUILD_SCRIPT), str(directory)], check=True)
    if not bzimage.is_file():
        return (
            f"no kernel with iommufd at {bzimage} (Debian's kernels have none): set "
            f"{KERNEL_DIR_VARIABLE} to a folder holding one, or build it there with "
            f"{BUILD_SCRIPT.relative_to(PROJECT)} DIR (Debian's linux-source-6.12, about "
            "11 minutes on 2 CPUs), or run the tests with DP_BUILD_TEST_KERNEL=1"
        )
    checksum = directory / "bzImage.sha256"
    if checksum.is_file():
        want = checksum.read_text().split()[0]
        got = hashlib.sha256(bzimage.read_bytes()).hexdigest()
        if got != want:
            return f"{bzimage} does not match {checksum.name} (sha256 {got})"
    return Kernel(bzimage)


def python_image(workdir: Path, project: Path = PROJECT) -> Path:
    """An ext4 image in `workdir`: python3.11, its stdlib and shared libraries,
    and dp with its dependencies, every module compiled. The folder it is
    made from is removed."""
    root = workdir / "pyroot"
    root.mkdir(parents=True)
    for name in ("proc", "sys", "dev", "tmp", "scenario"):
        (root / name).mkdir()
    (root / "usr/bin").mkdir(parents=True)
    shutil.copy2(PYTHON, root / "usr/bin/python3.11")
    stdlib = Path("/usr/lib/python3.11")
    shutil.copytree(
        stdlib,
        root / "usr/lib/python3.11",
        symlinks=True,
        ignore=lambda directory, names: [
            n
            for n in names
            if n == "__pycache__"
            or (Path(directory) == stdlib and n in _STDLIB_SKIPPED | {"dist-packages"})
        ],
    )
    site = root / "site"
    _run(
        sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
        "--target", site, project,
    )  # fmt: skip
    binaries = [PYTHON, *(root / "usr/lib/python3.11/lib-dynload").glob("*.so")]
    binaries += site.rglob("*.so")
    for library in _libraries(binaries):
        target = root / library.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, target)
    # Compiled here, once, by the guest's own python3.11 and named by the paths
    # the guest sees: the image is mounted read-only, and without them every
    # `py` compiles each module it imports from source again, under TCG.
    _run(
        PYTHON, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
        "-s", root, "-p", "/", root / "usr/lib/python3.11", site,
    )  # fmt: skip
    image = workdir / "pyroot.img"
    _run("mke2fs", "-q", "-F", "-t", "ext4", "-L", "pyroot", "-d", root, image, "300M")
    shutil.rmtree(root)
    return image


def _libraries(binaries: list[Path]) -> set[Path]:
    found: set[Path] = set()
    for binary in binaries:
        for line in _run("ldd", binary).splitlines():
            parts = line.split()
            for part in parts:
                if part.startswith("/") and Path(part).exists():
                    found.add(Path(part))
    # The loader and libc by their canonical paths as well as their links.
    return found | {p.resolve() for p in found}


def disk(path: Path, size: int = 1 << 20) -> Path:
    """An empty raw disk image, sparse: it takes no space until the guest writes."""
    with path.open("wb") as out:
        out.truncate(size)
    return path


class Guest:
    """Boots `kernel` with the python image on `cpus` vCPUs; `run` boots a
    fresh guest each time."""

    def __init__(self, kernel: Kernel, python_image: Path, cpus: int = 2) -> None:
        self.kernel = kernel
        self.python_image = python_image
        self.cpus = cpus
        self.boots: list[float] = []  # seconds from QEMU's start to its exit, per `run`

    def _initramfs(self, workdir: Path, steps: list[str]) -> Path:
        root = workdir / "initramfs"
        (root / "bin").mkdir(parents=True)
        shutil.copy2(shutil.which("busybox") or "/bin/busybox", root / "bin/busybox")
        modules = root / "modules"
        modules.mkdir()
        names = []
        for index, path in enumerate(self.kernel.module_files()):
            name = f"{index:02d}-{path.name}"
            shutil.copy2(path, modules / name)
            names.append(name)
        run_steps = "\n".join(
            f'echo "{MARK} {i} begin"\n{{\n{step}\n}} 2>&1\necho "{MARK} {i} end $?"'
            for i, step in enumerate(steps)
        )
        init = root / "init"
        init.write_text(
            f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /py
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in {" ".join(names)}; do
  insmod /modules/$m || echo "insmod $m failed"
done
mount -t ext4 -o ro "$(findfs LABEL=pyroot)" /py
mount --bind /proc /py/proc
mount --bind /sys /py/sys
mount --bind /dev /py/dev
mount -t tmpfs tmpfs /py/tmp
mount --bind /scenario /py/scenario
# dp and its dependencies run in the image, with the guest's /proc, /sys and /dev.
py() {{ PYTHONPATH=/site PYTHONDONTWRITEBYTECODE=1 chroot /py /usr/bin/python3.11 "$@"; }}
{run_steps}
echo "{MARK} done"
poweroff -f
"""
        )
        init.chmod(0o755)
        image = workdir / "initramfs.cpio"
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
        with image.open("wb") as out:
            subprocess.run(
                ["cpio", "-o", "-H", "newc", "--quiet"],
                input="\n".join(files).encode(),
                stdout=out,
                cwd=root,
                check=True,
            )
        return image

    # -- running -----------------------------------------------------------------

    def run(
        self,
        workdir: Path,
        qemu_args: list[str],
        steps: list[str],
        *,
        files: dict[str, str],
        binaries: dict[str, Path] | None = None,
        timeout: float = 300,
    ) -> list[tuple[int, str]]:
        """Boot with `qemu_args` (devices and drives) and run each of `steps`, a
        piece of shell run as root in the guest, where `py ARGS` runs
        python3.11 with dp in the image, and `files` (text) and `binaries`
        (copied, executable) are under /scenario;
        returns each step's exit status and output."""
        scenario = workdir / "initramfs" / "scenario"
        scenario.mkdir(parents=True)
        for name, text in files.items():
            (scenario / name).write_text(text)
        for name, path in (binaries or {}).items():
            shutil.copy2(path, scenario / name)
        initrd = self._initramfs(workdir, steps)
        command = [
            "qemu-system-x86_64",
            *("-accel", "tcg", "-m", "768", "-smp", str(self.cpus)),
            *("-machine", "q35,kernel-irqchip=split"),
            *("-device", "intel-iommu,intremap=on,caching-mode=on"),
            *("-nographic", "-vga", "none", "-nic", "none", "-no-reboot"),
            *("-kernel", str(self.kernel.vmlinuz), "-initrd", str(initrd)),
            *("-append", os.environ.get("DP_GUEST_APPEND", KERNEL_ARGUMENTS)),
            *("-drive", f"file={self.python_image},if=none,id=py,format=raw,readonly=on"),
            *("-device", "pcie-root-port,id=rp-py,chassis=90"),
            *("-device", "virtio-blk-pci,drive=py,bus=rp-py"),
        ]
        command += qemu_args
        started = time.monotonic()
        try:
            # On a timeout, subprocess.run kills QEMU before it raises.
            result = subprocess.run(
                command, capture_output=True, timeout=timeout, env={**os.environ, "TERM": "dumb"}
            )
        finally:
            self.boots.append(round(time.monotonic() - started, 1))
            # The initramfs (busybox, the scenario's files and binaries) is
            # rebuilt for every boot: only the console is kept, for whoever
            # debugs a failure.
            shutil.rmtree(workdir / "initramfs", ignore_errors=True)
            initrd.unlink(missing_ok=True)
        console = result.stdout.decode(errors="replace").replace("\r", "")
        (workdir / "console.txt").write_text(console)
        return _sections(console, len(steps))


def _sections(console: str, count: int) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for key in range(count):
        begin = f"{MARK} {key} begin\n"
        if begin not in console:
            raise AssertionError(f"the guest never ran step {key}; console:\n{console[-4000:]}")
        body = console.split(begin, 1)[1]
        end = f"{MARK} {key} end "
        if end not in body:
            raise AssertionError(f"the guest stopped in step {key}; console:\n{console[-4000:]}")
        output, rest = body.split(end, 1)
        found.append((int(rest.split("\n", 1)[0]), output))
    return found
