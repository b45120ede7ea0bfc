"""The files a prepared DRA claim gets: its CDI spec, and its KEP-5304 metadata.

For a claim, in the CDI spec directory:

- `<driver>_claim_<UID>.json`, kind `<driver>/claim`, a device
  `<UID>-<device>` per device with the VFIO nodes Allocate gives it;
- `<driver>_metadata_<UID>_<request>.json`, kind `<driver>/metadata`, a
  device `<UID>_<request>` that bind-mounts the request's metadata file
  read-only where the core says (`dra_metadata`), as the Kubernetes helper
  names them (`kubeletplugin/metadata.go`);

and the metadata file itself, `<metadata dir>/<namespace>_<claim>/<request>/
metadata.json`: the JSON stream of `DeviceMetadata` objects, newest version
first. Every file is written through a temporary file and a rename, so a
runtime never reads half of one; they are left in place at shutdown, and
removed when the claim is unprepared.

The names never start with `dp-`, which the device-plugin front end's spec
directory keeps as its own (`SpecDirectory`), so neither removes the other's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dp_core import CdiDevice, CdiMount, CdiSpec, PreparedClaim
from dp_core.claims import ClaimRef
from dp_core.dra_metadata import claim_cdi_kind, request_metadata
from dp_server.cdi.document import render
from dp_server.files import write_atomically

__all__ = ["METADATA_FILE", "ClaimFiles"]

METADATA_FILE = "metadata.json"
# As the Kubernetes helper mounts it: read-only, nothing to execute or open as a device.
_MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")


class ClaimFiles:
    """The claim files of `driver` in `spec_dir` and `metadata_dir`."""

    def __init__(self, driver: str, spec_dir: Path, metadata_dir: Path) -> None:
        self.driver = driver
        self.spec_dir = Path(spec_dir)
        self.metadata_dir = Path(metadata_dir)

    def claim_spec_path(self, uid: str) -> Path:
        return self.spec_dir / f"{self.driver}_claim_{uid}.json"

    def metadata_spec_path(self, uid: str, request: str) -> Path:
        return self.spec_dir / f"{self.driver}_metadata_{uid}_{request}.json"

    def metadata_path(self, claim: ClaimRef, request: str) -> Path:
        return self._claim_dir(claim) / request / METADATA_FILE

    def write(self, prepared: PreparedClaim) -> None:
        """Write every file of `prepared` (the same content again changes nothing
        a reader sees); raises OSError naming the file that could not be written."""
        claim = prepared.claim
        devices = tuple(
            CdiDevice(f"{claim.uid}-{device.name}", device.edits.devices)
            for device in prepared.devices
            if device.edits.devices
        )
        if devices:
            kind = claim_cdi_kind(self.driver)
            spec = CdiSpec(self.claim_spec_path(claim.uid).stem, kind, devices)
            _write(self.claim_spec_path(claim.uid), render(spec))
        for request in request_metadata(self.driver, prepared):
            host = self.metadata_path(claim, request.request)
            stream = "".join(json.dumps(obj) + "\n" for obj in request.objects)
            _makedirs(host.parent)
            _write(host, stream.encode())
            kind, _, name = request.cdi_device_id.partition("=")
            mount = CdiMount(str(host), request.container_path, _MOUNT_OPTIONS)
            spec = CdiSpec(
                self.metadata_spec_path(claim.uid, request.request).stem,
                kind,
                (CdiDevice(name, mounts=(mount,)),),
            )
            _write(self.metadata_spec_path(claim.uid, request.request), render(spec))

    def remove(self, claim: ClaimRef) -> None:
        """Remove every file of `claim`, whatever is left of them; raises OSError."""
        targets = [self.claim_spec_path(claim.uid)]
        try:
            targets += sorted(self.spec_dir.glob(f"{self.driver}_metadata_{claim.uid}_*.json"))
        except OSError:
            pass  # a directory that cannot be listed: the claim spec is tried all the same
        for target in targets:
            target.unlink(missing_ok=True)
        directory = self._claim_dir(claim)
        if directory.exists():
            shutil.rmtree(directory)

    def _claim_dir(self, claim: ClaimRef) -> Path:
        return self.metadata_dir / f"{claim.namespace}_{claim.name}"


def _makedirs(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OSError(error.errno, f"cannot make {path}: {error.strerror or error}") from None


def _write(target: Path, data: bytes) -> None:
    try:
        write_atomically(target, data)
    except OSError as error:
        raise OSError(error.errno, f"cannot write {target}: {error.strerror or error}") from None
