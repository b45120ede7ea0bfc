"""Container Device Interface specs (docs/design.md §9): the naming rules
(`names`), what a spec says (`spec`), the device-plugin front end's spec per
resource (`resources`), and a prepared DRA claim's specs (`claims`)."""

from .claims import (
    claim_device_id,
    claim_kind,
    claim_spec,
    claim_spec_name,
    metadata_device_id,
    metadata_spec,
    metadata_spec_prefix,
)
from .names import CLASS_PREFIX, SPEC_PREFIX, cdi_kind, device_name_error, qualified_name, spec_name
from .resources import CdiKeeper, resource_spec
from .spec import (
    MIN_CDI_VERSION,
    CdiDevice,
    CdiMount,
    CdiSpec,
    CdiSpecsChanged,
    CdiSpecsWritten,
    minimum_version,
)

__all__ = [
    "claim_spec_name",
    "metadata_spec_prefix",
    "CLASS_PREFIX",
    "MIN_CDI_VERSION",
    "SPEC_PREFIX",
    "CdiDevice",
    "CdiKeeper",
    "CdiMount",
    "CdiSpec",
    "CdiSpecsChanged",
    "CdiSpecsWritten",
    "cdi_kind",
    "claim_device_id",
    "claim_kind",
    "claim_spec",
    "device_name_error",
    "metadata_device_id",
    "metadata_spec",
    "minimum_version",
    "qualified_name",
    "resource_spec",
    "spec_name",
]
