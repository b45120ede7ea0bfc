"""The ledger both front ends share: which holder has each IOMMU group.

It is keyed by a neutral `Holder`, and knows no front end.
"""

from .book import Ledger
from .holder import Holder, holds

__all__ = ["Holder", "Ledger", "holds"]
