"""The files a prepared DRA claim gets: its CDI specs, and its KEP-5304 metadata.

What each spec holds and what it is called is the core's (`dp_core.cdi.claims`:
the claim's spec, and one per request that mounts the request's metadata);
this writes them in the CDI spec directory, with the metadata file itself,
`<metadata dir>/<namespace>_<claim>/<request>/metadata.json`: the JSON stream
of `DeviceMetadata` objects (`dp_core.dra.metadata`), newest version first.
Every file is written through a temporary file and a rename, so a runtime
never reads half of one; they are left in place at shutdown, and removed when
the claim is unprepared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dp_core import ClaimRef, PreparedClaim
from dp_core.cdi import claim_spec, claim_spec_name, metadata_spec, metadata_spec_prefix
from dp_core.dra import request_envs, request_metadata
from dp_server.cdi.document import render
from dp_server.files import write_atomically

__all__ = ["METADATA_FILE", "ClaimFiles"]

METADATA_FILE = "metadata.json"


class ClaimFiles:
    """The claim files of `driver` in `spec_dir` and `metadata_dir`."""

    def __init__(self, driver: str, spec_dir: Path, metadata_dir: Path) -> None:
        self.driver = driver
        self.spec_dir = Path(spec_dir)
        self.metadata_dir = Path(metadata_dir)

    def spec_path(self, name: str) -> Path:
        return self.spec_dir / f"{name}.json"

    def metadata_path(self, claim: ClaimRef, request: str) -> Path:
        return self._claim_dir(claim) / request / METADATA_FILE

    def write(self, prepared: PreparedClaim) -> None:
        """Write every file of `prepared` (the same content again changes nothing
        a reader sees); raises OSError naming the file that could not be written."""
        claim = prepared.claim
        devices = ((device.name, device.edits.devices) for device in prepared.devices)
        requests = ((e.request, e.env) for e in request_envs(prepared))
        spec = claim_spec(self.driver, claim.uid, devices, requests)
        if spec is not None:
            _write(self.spec_path(spec.name), render(spec))
        for request in request_metadata(self.driver, prepared):
            host = self.metadata_path(claim, request.request)
            stream = "".join(json.dumps(obj) + "\n" for obj in request.objects)
            _makedirs(host.parent)
            _write(host, stream.encode())
            spec = metadata_spec(
                self.driver, claim.uid, request.request, str(host), request.container_path
            )
            _write(self.spec_path(spec.name), render(spec))

    def remove(self, claim: ClaimRef) -> None:
        """Remove every file of `claim`, whatever is left of them; raises OSError."""
        targets = [self.spec_path(claim_spec_name(self.driver, claim.uid))]
        try:
            prefix = metadata_spec_prefix(self.driver, claim.uid)
            targets += sorted(self.spec_dir.glob(f"{prefix}*.json"))
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
