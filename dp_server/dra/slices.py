"""Publishing this node's DRA pool as ResourceSlices, and keeping them as published.

`SlicePublisher` takes the pool's whole content from the core (`publish`,
which never waits) and, in its own task (`run`), makes the API server hold
exactly that: one pool per node, named after the node, cut into slices by
`slice_objects.cut`, each owned by the Node object. It works like the Go
helper's controller (`k8s.io/dynamic-resource-allocation/resourceslice`):

- it lists this node's slices of its driver (field selectors `spec.nodeName`
  and `spec.driver`) and watches them from the list's resourceVersion, so what
  it knows of the server is never older than the last event;
- it writes only when the server's slices differ from the wanted content;
  then the pool generation goes one past the highest on the server, every
  slice of the pool is rewritten with it (updates with the slice's
  resourceVersion as precondition, creates with `generateName`), and slices
  of another pool, an older generation or beyond the wanted count are deleted;
  so slices left by an earlier run are cleaned up at start, and a slice that
  someone else changed or deleted is put back;
- a 409 Conflict or a 404 on an update means its view was stale, and a 410
  Gone on the watch that its version is too old: it ends the watch, lists
  again and watches from the new list (a list beside a running watch could
  overwrite a change the watch had brought). Its view of each slice is the
  newest state the watch or its own writes' answers showed (`SliceCache`);
- nothing ends it but cancellation: a refused, reset or timed-out request, a
  5xx, six stale views in a row, or a fault of its own, each ends the session
  and it starts again after an exponential backoff with jitter, for as long
  as it runs; `failures` and the log say what happened. The rest of dp is
  never held up by any of this;
- after each write it compares what it sent with what the server stored
  (`features_kept`): a server without partitionable devices or device taints
  drops their fields. What it learns is handed to `on_features` (the core's
  `DraFeaturesObserved`) when it is new, and the pass stops if the content
  changed with it; from then on its comparisons leave out the fields the
  server drops, so what the server cannot keep is not written again and again.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterable
from typing import Any

from lightkube.resources.resource_v1 import ResourceSlice

from dp_core import DraFeaturesObserved, MetricFamily, Sample
from dp_core.slices import PoolContent
from dp_server.dra.api import TRANSIENT_ERRORS, ApiError, KubeApi, is_status
from dp_server.dra.slice_cache import SliceCache, slice_name
from dp_server.dra.slice_objects import (
    COUNTERS,
    TAINTS,
    content_key,
    cut,
    features_kept,
    node_owner,
    slice_object,
)

__all__ = ["Backoff", "SlicePublisher"]

_log = logging.getLogger("dp.dra")

# The feature gates whose fields features_kept looks for.
_GATES = {COUNTERS: "DRAPartitionableDevices", TAINTS: "DRADeviceTaints"}

# Conflicts in a row before the publisher backs off instead of retrying at once.
_MAX_IMMEDIATE_RETRIES = 5


class Backoff:
    """Exponential delays from `first` to `cap` seconds, each scaled by a random 0.5-1."""

    def __init__(self, first: float = 0.5, cap: float = 30.0, rng: random.Random | None = None):
        self.first = first
        self.cap = cap
        self._rng = rng or random.Random()

    def delay(self, failures: int) -> float:
        base = min(self.cap, self.first * 2.0 ** max(0, failures - 1))
        return base * self._rng.uniform(0.5, 1.0)


class _Stale(Exception):
    """The view of the server was out of date; list again."""


class SlicePublisher:
    """Keeps this node's ResourceSlices of one driver equal to the last `publish`ed content.

    `watch_period` bounds each watch request, in seconds (a random value in
    the range, as client-go's reflector does, so that many nodes do not
    reconnect at once). `on_features` hears what a write showed of the
    server's DRA features, each finding once.
    """

    def __init__(
        self,
        api: KubeApi,
        *,
        watch_period: tuple[float, float] = (300.0, 600.0),
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
        on_features: Callable[[DraFeaturesObserved], object] | None = None,
    ) -> None:
        self.api = api
        self._on_features = on_features
        # COUNTERS/TAINTS -> whether the server kept that feature's fields when last sent.
        self.features: dict[str, bool] = {}
        self.watch_period = watch_period
        self.backoff = backoff or Backoff()
        self._rng = rng or random.Random()
        self._wanted: PoolContent | None = None
        self._changed = asyncio.Event()
        self._node_uid: str | None = None
        self._cache = SliceCache()
        self._version = ""
        self._in_a_row = 0  # sessions ended by a failure or a stale view since the last sync
        self.generation = 0
        self.synced = False
        self.conflicts = 0
        self.relists = 0
        self.failures = 0

    def publish(self, content: PoolContent) -> None:
        """Make `content` the pool's wanted content; the running task writes it when it can."""
        if content == self._wanted:
            return
        if self._wanted is not None and (content.driver, content.node_name) != (
            self._wanted.driver,
            self._wanted.node_name,
        ):
            raise ValueError("a publisher serves one driver on one node")
        self._wanted = content
        self.synced = False
        self._changed.set()

    async def run(self) -> None:
        """Publish until cancelled; the first content must come from `publish`.

        Nothing but cancellation ends it: whatever ends a session is logged and
        counted, and the next session starts after a backoff (at once after a
        stale view, five times in a row)."""
        while self._wanted is None:
            await self._changed.wait()
        while True:
            try:
                await self._session()
            except _Stale as stale:
                self.synced = False
                self._in_a_row += 1
                if self._in_a_row <= _MAX_IMMEDIATE_RETRIES:
                    continue
                await self._failed(stale)
            except Exception as error:  # noqa: BLE001 - no failure may end the publisher
                self.synced = False
                self._in_a_row += 1
                await self._failed(error)

    async def _failed(self, error: BaseException) -> None:
        self.failures += 1
        delay = self.backoff.delay(self._in_a_row)
        fields = _fields(error=_describe(error), retry_in=round(delay, 3), failures=self._in_a_row)
        if isinstance(error, (*TRANSIENT_ERRORS, _Stale)):
            _log.warning("kube-api-unavailable", extra=fields)
        else:
            _log.error("resourceslice-publisher-failed", extra=fields, exc_info=error)
        await asyncio.sleep(delay)

    async def _session(self) -> None:
        """List, watch from the list, and keep the server's slices as wanted
        until something ends the watch or shows the view stale."""
        wanted = self._wanted
        assert wanted is not None
        if self._node_uid is None:
            self._node_uid = await self.api.node_uid(wanted.node_name)
        items, self._version = await self.api.list_slices(wanted.node_name, wanted.driver)
        self._cache = SliceCache(items)
        watcher = asyncio.create_task(self._watch(), name="dp-resourceslice-watch")
        try:
            while True:
                self._changed.clear()
                await self._reconcile()
                self.synced = True
                self._in_a_row = 0
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait({changed, watcher}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
                if watcher.done():
                    watcher.result()  # raises what ended the watch
                    raise _Stale  # pragma: no cover - the watch loop never returns
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch(self) -> None:
        wanted = self._wanted
        assert wanted is not None
        while True:
            period = self._rng.uniform(*self.watch_period)
            try:
                await self.api.watch_slices(
                    wanted.node_name, wanted.driver, self._version, period, self._seen
                )
            except ApiError as error:
                if not is_status(error, 410):
                    raise
                _log.info("resourceslice-watch-expired", extra=_fields(relist=True))
                self.relists += 1
                raise _Stale("the watch's resourceVersion is too old") from None

    def _seen(self, kind: str, obj: ResourceSlice) -> None:
        if kind == "DELETED":
            self._cache.delete(obj)
        else:
            self._cache.put(obj)
        if obj.metadata is not None and obj.metadata.resourceVersion:
            self._version = obj.metadata.resourceVersion
        self._changed.set()

    async def _reconcile(self) -> None:
        """One pass: nothing if the server holds the wanted content, else a new generation."""
        wanted = self._wanted
        uid = self._node_uid
        assert wanted is not None and uid is not None
        owner = node_owner(wanted.node_name, uid)
        bodies = cut(wanted)
        dropped = frozenset(f for f, kept in self.features.items() if not kept)
        desired = sorted(
            content_key(slice_object(wanted, body, generation=0, count=0, owner=owner), dropped)
            for body in bodies
        )
        # Slices the field selectors should not have given us are never touched.
        mine = [s for s in self._cache.values() if _spec_ok(s, wanted)]
        in_pool = [s for s in mine if _pool(s)[0] == wanted.pool]
        other_pools = [s for s in mine if _pool(s)[0] != wanted.pool]
        top = max((_pool(s)[1] for s in in_pool), default=0)
        current = [s for s in in_pool if _pool(s)[1] == top]
        if (
            not other_pools
            and len(current) == len(in_pool) == len(bodies)
            and all(_pool(s)[2] == len(bodies) for s in current)
            and sorted(content_key(s, dropped) for s in current) == desired
        ):
            self.generation = top
            return
        generation = top + 1
        reuse = sorted(in_pool, key=_name)

        async def write(index: int, body: Any) -> tuple[ResourceSlice, ResourceSlice]:
            if index < len(reuse):
                old = reuse[index]
                assert old.metadata is not None
                obj = slice_object(
                    wanted,
                    body,
                    generation=generation,
                    count=len(bodies),
                    owner=owner,
                    name=old.metadata.name,
                    resource_version=old.metadata.resourceVersion,
                )
                return obj, await self.api.replace_slice(obj)
            obj = slice_object(wanted, body, generation=generation, count=len(bodies), owner=owner)
            return obj, await self.api.create_slice(obj)

        # The slices of a generation go out together: a health change reaches
        # the scheduler once the last of them is written, and the scheduler
        # ignores a generation until it is complete.
        outcomes = await asyncio.gather(
            *(write(index, body) for index, body in enumerate(bodies)), return_exceptions=True
        )
        stale = False
        failure: BaseException | None = None
        for outcome in outcomes:
            if isinstance(outcome, ApiError) and is_status(outcome, 409, 404):
                self.conflicts += 1
                stale = True
            elif isinstance(outcome, BaseException):
                failure = failure or outcome
            else:
                obj, written = outcome
                self._cache.put(written)
                self._learn(obj, written)
        if failure is not None:
            raise failure
        if stale:
            raise _Stale("a slice changed or went since it was read")
        if self._wanted is not wanted:
            return  # what was learned changed the content: start again with it
        for old in reuse[len(bodies) :] + other_pools:
            await self.api.delete_slice(_name(old))
            self._cache.deleted_by_us(_name(old))
        self.generation = generation
        _log.info(
            "resourceslices-published",
            extra=_fields(
                pool=wanted.pool,
                generation=generation,
                slices=len(bodies),
                devices=len(wanted.devices),
                deleted=len(reuse[len(bodies) :]) + len(other_pools),
            ),
        )

    def _learn(self, sent: ResourceSlice, stored: ResourceSlice) -> None:
        found = {
            f: kept
            for f, kept in features_kept(sent, stored).items()
            if self.features.get(f) != kept
        }
        if not found:
            return
        self.features.update(found)
        if self._on_features is not None:
            self._on_features(DraFeaturesObserved(found.get(COUNTERS), found.get(TAINTS)))

    def families(self) -> Iterable[MetricFamily]:
        yield from self.api.calls.families()
        yield MetricFamily(
            "gauge",
            "dp_dra_pool_generation",
            "The generation of this node's DRA pool last written or found on the API server.",
            (Sample((), self.generation),),
        )
        yield MetricFamily(
            "gauge",
            "dp_dra_slices_synced",
            "1 when the API server holds the pool content dp last computed, else 0.",
            (Sample((), 1 if self.synced and not self._changed.is_set() else 0),),
        )
        yield MetricFamily(
            "gauge",
            "dp_dra_api_feature",
            "1 when the API server kept a DRA feature's fields in the last slice that had "
            "them, 0 when it dropped them; absent until a write had them.",
            tuple(
                Sample((("feature", _GATES[f]),), 1 if kept else 0)
                for f, kept in sorted(self.features.items())
            ),
        )
        yield MetricFamily(
            "counter",
            "dp_dra_slice_conflicts_total",
            "ResourceSlice updates refused as stale (409 or 404), each followed by a list.",
            (Sample((), self.conflicts),),
        )
        yield MetricFamily(
            "counter",
            "dp_dra_api_failures_total",
            "Times the API server could not be reached or failed, each followed by a backoff.",
            (Sample((), self.failures),),
        )


_name = slice_name


def _pool(obj: ResourceSlice) -> tuple[str, int, int]:
    assert obj.spec is not None
    pool = obj.spec.pool
    return pool.name, pool.generation, pool.resourceSliceCount


def _spec_ok(obj: ResourceSlice, wanted: PoolContent) -> bool:
    return (
        obj.spec is not None
        and obj.spec.nodeName == wanted.node_name
        and obj.spec.driver == wanted.driver
    )


def _describe(error: BaseException) -> str:
    if isinstance(error, _Stale):
        return f"stale view: {error}"
    if isinstance(error, ApiError):
        return f"{error.status.code} {error.status.reason}: {error.status.message}"
    return f"{type(error).__name__}: {error}"


def _fields(**fields: object) -> dict[str, dict[str, object]]:
    return {"dp_fields": fields}
