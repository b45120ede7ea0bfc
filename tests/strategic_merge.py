"""Kubernetes' strategic merge patch, as far as the deploy/ patches use it.

Maps merge key by key; a list of objects merges item by item on its merge key
(the `patchMergeKey` of the Kubernetes API types: a container by `name`, a
volume mount by `mountPath`); any other value is replaced. kubectl's own
kustomize is the reference: tests/test_packaging.py compares with it where
kubectl is installed.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["MERGE_KEYS", "strategic_merge"]

# k8s.io/api/core/v1/types.go, `patchMergeKey` of each list field.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "tolerations": None,  # atomic: replaced whole
}


def strategic_merge(base: Any, patch: Any, field: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = (
                strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
            )
        return merged
    key = MERGE_KEYS.get(field or "")
    if isinstance(base, list) and isinstance(patch, list) and key is not None:
        merged_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            at = [i for i, old in enumerate(merged_list) if old.get(key) == item[key]]
            if at:
                merged_list[at[0]] = strategic_merge(merged_list[at[0]], item)
            else:
                merged_list.append(copy.deepcopy(item))
        return merged_list
    return copy.deepcopy(patch)
