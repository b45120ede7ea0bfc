"""What must be written so the API server holds a pool's wanted content: a plan.

`plan_pool` compares the wanted content, cut into slices, with this node's
slices of the driver as the publisher knows them, and says what to write:

- nothing, when the newest complete generation holds exactly the wanted
  content (apart from the fields the server is known to drop);
- one update, at the same generation, when the pool keeps its slices and
  exactly one of them must change (a health change, most often): one write
  is atomic, so the scheduler never sees the pool half changed, which is why
  the Go helper keeps the generation then too ("at most one update API call
  is necessary", `resourceslicecontroller.go`);
- otherwise the next generation, every slice of it (an update of a slice it
  reuses, with that slice's resourceVersion as precondition, or a create),
  and the deletes of what is left: slices of an older generation, of another
  pool, or beyond the wanted count. So slices left by an earlier run are
  cleaned up at start, and a slice someone else changed or deleted is put
  back.

Slices are matched to the wanted ones by what they hold, not by name.
"""

from __future__ import annotations

import attrs
from lightkube.models.meta_v1 import OwnerReference
from lightkube.resources.resource_v1 import ResourceSlice

from dp_core.dra import PoolContent
from dp_server.dra.slice_cache import slice_name
from dp_server.dra.slice_objects import SliceBody, content_key, cut, slice_object

__all__ = ["Plan", "SliceWrite", "plan_pool", "pool_of"]


@attrs.frozen
class SliceWrite:
    """One slice of the new generation: an update of `name` at `resource_version`,
    or (no name) a create."""

    body: SliceBody
    name: str | None = None
    resource_version: str | None = None

    def object(
        self, content: PoolContent, generation: int, count: int, owner: OwnerReference
    ) -> ResourceSlice:
        return slice_object(
            content,
            self.body,
            generation=generation,
            count=count,
            owner=owner,
            name=self.name,
            resource_version=self.resource_version,
        )


@attrs.frozen
class Plan:
    """Write `writes` at `generation` of a pool of `count` slices, then delete `deletes`."""

    generation: int
    count: int
    writes: tuple[SliceWrite, ...]
    deletes: tuple[str, ...] = ()


def pool_of(obj: ResourceSlice) -> tuple[str, int, int]:
    """(pool name, generation, resourceSliceCount) of a slice."""
    assert obj.spec is not None
    pool = obj.spec.pool
    return pool.name, pool.generation, pool.resourceSliceCount


def _ours(obj: ResourceSlice, wanted: PoolContent) -> bool:
    return (
        obj.spec is not None
        and obj.spec.nodeName == wanted.node_name
        and obj.spec.driver == wanted.driver
    )


def plan_pool(
    wanted: PoolContent,
    slices: list[ResourceSlice],
    owner: OwnerReference,
    dropped: frozenset[str] = frozenset(),
) -> tuple[int, Plan | None]:
    """The pool's newest generation on the server, and what to write (None: nothing).

    `dropped` names the features (`COUNTERS`, `TAINTS`) whose fields the
    server drops: what it would store of the wanted content is compared, so
    a write it cannot keep as sent is not made again and again.
    """
    bodies = cut(wanted)
    desired_by_body = [
        content_key(slice_object(wanted, body, generation=0, count=0, owner=owner), dropped)
        for body in bodies
    ]
    desired = sorted(desired_by_body)
    # Slices the field selectors should not have given us are never touched.
    mine = [s for s in slices if _ours(s, wanted)]
    in_pool = sorted((s for s in mine if pool_of(s)[0] == wanted.pool), key=slice_name)
    other_pools = [s for s in mine if pool_of(s)[0] != wanted.pool]
    top = max((pool_of(s)[1] for s in in_pool), default=0)
    current = [s for s in in_pool if pool_of(s)[1] == top]
    if (
        not other_pools
        and len(current) == len(in_pool) == len(bodies)
        and all(pool_of(s)[2] == len(bodies) for s in current)
    ):
        keys = {slice_name(s): content_key(s, dropped) for s in current}
        unmatched_slices = [s for s in current if keys[slice_name(s)] not in desired]
        unmatched_bodies = [
            body
            for body, key in zip(bodies, desired_by_body, strict=True)
            if key not in keys.values()
        ]
        if sorted(keys.values()) == desired:
            return top, None
        if len(unmatched_slices) == len(unmatched_bodies) == 1:
            (old,) = unmatched_slices
            (body,) = unmatched_bodies
            assert old.metadata is not None
            write = SliceWrite(body, old.metadata.name, old.metadata.resourceVersion)
            return top, Plan(top, len(bodies), (write,))
    writes = []
    for index, body in enumerate(bodies):
        if index < len(in_pool):
            old = in_pool[index]
            assert old.metadata is not None
            writes.append(SliceWrite(body, old.metadata.name, old.metadata.resourceVersion))
        else:
            writes.append(SliceWrite(body))
    deletes = [slice_name(s) for s in in_pool[len(bodies) :] + other_pools]
    return top, Plan(top + 1, len(bodies), tuple(writes), tuple(deletes))
