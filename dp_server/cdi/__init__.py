"""CDI spec files: the JSON a spec is written as, and a spec directory dp keeps in step.

The core says what each spec holds (`dp_core.CdiSpec`); this package only
renders and writes it. Any front end that hands devices to containers
through CDI uses it: the device-plugin one, and the DRA one.
"""

from dp_server.cdi.directory import SpecDirectory, SyncResult
from dp_server.cdi.document import render, spec_document

__all__ = ["SpecDirectory", "SyncResult", "render", "spec_document"]
