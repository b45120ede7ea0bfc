#!/bin/bash
# Builds the kernel the real-kernel tests boot to see iommufd, VFIO character
# devices and real mdevs (tests/test_real_kernel_iommufd.py): Debian's
# linux-source-6.12, x86_64 defconfig plus kvm_guest.config, with everything
# needed built in and no modules. Debian's own kernels have no CONFIG_IOMMUFD.
#
#   scripts/build-test-kernel.sh DIR    # writes DIR/bzImage, DIR/config, DIR/bzImage.sha256
#
# Then run the tests with DP_TEST_KERNEL_DIR=DIR. It takes about 11 minutes
# on 2 CPUs and needs the source package (bookworm-backports on Debian 12):
#   apt-get install -t bookworm-backports linux-source-6.12
# plus a compiler toolchain: build-essential bc bison flex libelf-dev libssl-dev.
# The tree is unpacked and built in ${KBUILD:-/tmp/kbuild}.
set -euo pipefail
out=$(realpath -m "${1:?usage: $0 OUTPUT_DIR}")
source=/usr/src/linux-source-6.12.tar.xz
[ -f "$source" ] || {
  echo "$0: no $source (apt-get install -t bookworm-backports linux-source-6.12)" >&2
  exit 1
}
mkdir -p "${KBUILD:-/tmp/kbuild}" "$out"
cd "${KBUILD:-/tmp/kbuild}"
[ -d linux-source-6.12 ] || tar xf "$source"
cd linux-source-6.12
make -s defconfig
make -s kvm_guest.config
./scripts/config \
  -e PCI -e PCI_MSI -e PCIEPORTBUS -e HOTPLUG_PCI -e HOTPLUG_PCI_PCIE \
  -e IOMMU_SUPPORT -e INTEL_IOMMU -e INTEL_IOMMU_DEFAULT_ON -e IRQ_REMAP -e IOMMUFD \
  -e VFIO -e VFIO_GROUP -e VFIO_CONTAINER -e VFIO_IOMMU_TYPE1 -e VFIO_DEVICE_CDEV -e VFIO_PCI -e VFIO_PCI_CORE \
  -e VFIO_MDEV -e SAMPLE_VFIO_MDEV_MTTY -e SAMPLES -e SAMPLE_VFIO_MDEV_MDPY \
  -e BLK_DEV_NVME -e E1000 -e E1000E -e VIRTIO_PCI -e VIRTIO_BLK -e VIRTIO_NET \
  -e EXT4_FS -e DEVTMPFS -e DEVTMPFS_MOUNT -e TMPFS -e BLK_DEV_INITRD -e RD_GZIP \
  -e SERIAL_8250 -e SERIAL_8250_CONSOLE -e PCI_IOV -e PCI_STUB \
  -e VIRTIO_CONSOLE -e HW_RANDOM_VIRTIO \
  -d DEBUG_INFO -d DEBUG_INFO_DWARF5 -d DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT -e DEBUG_INFO_NONE \
  -d MODULES
make -s olddefconfig
for option in IOMMUFD VFIO_DEVICE_CDEV VFIO_PCI INTEL_IOMMU VFIO_CONTAINER SAMPLE_VFIO_MDEV_MTTY PCI_IOV; do
  grep -qx "CONFIG_$option=y" .config || { echo "$0: CONFIG_$option is not built in" >&2; exit 1; }
done
nice -n 15 make -j"$(nproc)" bzImage > ../build.log 2>&1 || { tail -30 ../build.log >&2; exit 1; }
cp arch/x86/boot/bzImage "$out/bzImage"
cp .config "$out/config"
(cd "$out" && sha256sum bzImage > bzImage.sha256)
echo "built $out/bzImage"
