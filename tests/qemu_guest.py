"""A real Linux kernel under QEMU, with an emulated Intel IOMMU, to run dp in.

Everything comes from Debian packages (see ../shared/qemu-notes.md for what
was tried): `qemu-system-x86`, `kmod`, `cpio`, `busybox-static`, `e2fsprogs`,
and the cloud kernel (or, with `Guest.with_kernel`, another flavour such as
the generic one), fetched with `apt-get download` and unpacked, never
installed. The guest boots from an initramfs whose busybox `/init` loads the
virtio and VFIO modules and runs the scenario's steps: pieces of shell run as
root (the operator's part, such as binding devices to vfio-pci), in which
`py` runs Debian's python3.11 chrooted into a read-only ext4 image that holds
it, its standard library and dp with its dependencies. Each step's output
comes back over the serial console between markers. The console of the last
boot is kept in `<workdir>/console.txt`.

`/dev/kvm` here cannot run QEMU's CPU models, so the guest is emulated (TCG).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
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
_TOOLS = ("qemu-system-x86_64", "busybox", "cpio", "mke2fs", "depmod", "modprobe", "apt-get")
_STDLIB_SKIPPED = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data"}

__all__ = ["PACKAGES", "Guest", "missing"]


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


def _run(*command: str | Path, **kwargs: object) -> str:
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, check=False, **kwargs
    )
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({result.returncode}):\n{result.stderr}")
    return result.stdout


class Guest:
    """Builds the boot files once in `workdir`; `run` boots a fresh guest each time."""

    def __init__(self, workdir: Path, project: Path) -> None:
        self.workdir = workdir
        self.modules: tuple[str, ...] = MODULES
        self.vmlinuz, self.modules_dir, self.version = self._kernel(
            workdir / "kernel", KERNEL_PACKAGE
        )
        self.python_image = self._python_image(workdir / "pyroot", project)

    def with_kernel(self, workdir: Path, package: str, modules: tuple[str, ...]) -> Guest:
        """The same guest (python image and all) on the kernel of another
        meta-package, such as the generic flavour, which has the host drivers
        the cloud one lacks; `/init` loads `modules` and what they need."""
        other = copy.copy(self)
        other.workdir = workdir
        other.modules = modules
        other.vmlinuz, other.modules_dir, other.version = self._kernel(workdir, package)
        return other

    # -- building ---------------------------------------------------------------

    @staticmethod
    def _kernel(directory: Path, meta_package: str) -> tuple[Path, Path, str]:
        directory.mkdir(parents=True, exist_ok=True)
        # The versioned package behind the meta-package; unpacked, not installed.
        depends = _run("apt-cache", "depends", meta_package)
        package = next(
            line.split(":", 1)[1].strip()
            for line in depends.splitlines()
            if line.strip().startswith("Depends: linux-image-")
        )
        _run("apt-get", "download", package, cwd=directory)
        (deb,) = directory.glob(f"{package}_*.deb")
        _run("dpkg", "-x", deb, directory / "root")
        (vmlinuz,) = (directory / "root" / "boot").glob("vmlinuz-*")
        version = vmlinuz.name.removeprefix("vmlinuz-")
        _run("depmod", "-b", directory / "root", version)
        return vmlinuz, directory / "root", version

    def _module_files(self) -> list[Path]:
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

    def _python_image(self, root: Path, project: Path) -> Path:
        """An ext4 image: python3.11, its stdlib and shared libraries, and dp."""
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
        for library in self._libraries(binaries):
            target = root / library.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(library, target)
        image = self.workdir / "pyroot.img"
        _run("mke2fs", "-q", "-F", "-t", "ext4", "-L", "pyroot", "-d", root, image, "300M")
        return image

    @staticmethod
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

    def _initramfs(self, workdir: Path, steps: list[str]) -> Path:
        root = workdir / "initramfs"
        (root / "bin").mkdir(parents=True)
        shutil.copy2(shutil.which("busybox") or "/bin/busybox", root / "bin/busybox")
        modules = root / "modules"
        modules.mkdir()
        names = []
        for index, path in enumerate(self._module_files()):
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
for m in {" ".join(names)}; do insmod /modules/$m || echo "insmod $m failed"; done
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
            *("-accel", "tcg", "-m", "768", "-smp", "2"),
            *("-machine", "q35,kernel-irqchip=split"),
            *("-device", "intel-iommu,intremap=on,caching-mode=on"),
            *("-nographic", "-vga", "none", "-nic", "none", "-no-reboot"),
            *("-kernel", str(self.vmlinuz), "-initrd", str(initrd)),
            *("-append", os.environ.get("DP_GUEST_APPEND", KERNEL_ARGUMENTS)),
            *("-drive", f"file={self.python_image},if=none,id=py,format=raw,readonly=on"),
            *("-device", "pcie-root-port,id=rp-py,chassis=90"),
            *("-device", "virtio-blk-pci,drive=py,bus=rp-py"),
        ]
        command += qemu_args
        result = subprocess.run(
            command, capture_output=True, timeout=timeout, env={**os.environ, "TERM": "dumb"}
        )
        console = result.stdout.decode(errors="replace").replace("\r", "")
        (workdir / "console.txt").write_text(console)  # for whoever debugs a failure
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
