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
- before it first writes the pool it asks which DRA features the cluster
  keeps: a server-side dry run of a slice that uses shared counters and a
  device taint (`probe_object`) comes back without the fields of a feature
  the server lacks, and nothing is stored. What it learns goes to
  `on_features` (the core's `DraFeaturesObserved`), whose answer is the pool
  the cluster can keep, so the rich pool never reaches a cluster that would
  store it weakened. It asks again every `relearn` seconds (a cluster
  upgraded to 1.36 turns both gates on) and a minute after a session failed
  (an API server restarted); a server that refuses dry runs is reported as
  unknown, and the core takes what it has not seen as absent;
- after each write it compares what it sent with what the server stored
  (`features_kept`): a difference from the dry run (API servers that
  disagree while they are upgraded one by one, a cluster changed since) goes
  to `on_features` too, and the dry run is made again a minute later. Its
  comparisons leave out the fields the server drops, so what the server
  cannot keep is not written again and again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Iterable

from lightkube.models.meta_v1 import OwnerReference
from lightkube.resources.resource_v1 import ResourceSlice

from dp_core import Backoff, DraFeaturesObserved, MetricFamily, Sample
from dp_core.dra import PoolContent
from dp_server.dra.api import TRANSIENT_ERRORS, ApiError, KubeApi, describe, is_status
from dp_server.dra.pacing import RepairPacer, jitter
from dp_server.dra.slice_cache import SliceCache
from dp_server.dra.slice_objects import COUNTERS, TAINTS, features_kept, node_owner, probe_object
from dp_server.dra.slice_plan import Plan, plan_pool

__all__ = ["SlicePublisher"]

_log = logging.getLogger("dp.dra")

# The feature gates whose fields features_kept looks for.
_GATES = {COUNTERS: "DRAPartitionableDevices", TAINTS: "DRADeviceTaints"}

# Conflicts in a row before the publisher backs off instead of retrying at once.
_MAX_IMMEDIATE_RETRIES = 5
# After a session failed (the API server may have been upgraded meanwhile),
# the features are asked again, but not more often than this (seconds).
_PROBE_AFTER_FAILURE = 60.0
# The answers to a dry run that say it cannot be made (a webhook that refuses
# dry runs, a policy), not that the server is away.
_PROBE_REFUSED = (400, 403, 404, 405, 415, 422)


class _Stale(Exception):
    """The view of the server was out of date; list again."""


class SlicePublisher:
    """Keeps this node's ResourceSlices of one driver equal to the last `publish`ed content.

    `watch_period` bounds each watch request, in seconds (a random value in
    the range, as client-go's reflector does, so that many nodes do not
    reconnect at once). `backoff` spaces the sessions after a failure,
    `repairs` the writes that put back what outside changes undid.
    `relearn` is how often (seconds) it asks again which DRA features the
    cluster keeps; `on_features` hears each new finding.
    """

    def __init__(
        self,
        api: KubeApi,
        *,
        watch_period: tuple[float, float] = (300.0, 600.0),
        backoff: Backoff | None = None,
        repairs: RepairPacer | None = None,
        relearn: float = 1800.0,
        rng: random.Random | None = None,
        on_features: Callable[[DraFeaturesObserved], object] | None = None,
    ) -> None:
        self.api = api
        self.relearn = relearn
        self._learned_at: float | None = None  # when the last dry run answered
        # A session failed, or a write disagreed with the dry run: ask again soon.
        self._learn_soon = False
        self._on_features = on_features
        # COUNTERS/TAINTS -> whether the server kept that feature's fields when last sent.
        self.features: dict[str, bool] = {}
        self.watch_period = watch_period
        self.backoff = backoff or Backoff(first=0.5, cap=30.0)
        self.repairs = repairs or RepairPacer()
        self._rng = rng or random.Random()
        self._wanted: PoolContent | None = None
        self._changed = asyncio.Event()  # the content, or what the server holds, changed
        self._new_content = asyncio.Event()  # the content changed
        self._held: PoolContent | None = None  # what the server held when last seen in step
        self._node_uid: str | None = None
        self._owner_check = False  # a slice went: the Node may have gone with it
        self._cache = SliceCache()
        self._version = ""
        self._in_a_row = 0  # sessions ended by a failure or a stale view since the last sync
        self.node_present: bool | None = None  # None: not asked yet
        self.generation = 0
        self.synced = False
        self.conflicts = 0
        self.relists = 0
        self.failures = 0
        self.probes = 0

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
        self._new_content.set()

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
                self._owner_check = True  # a 404: maybe the garbage collector's doing
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
        self._learn_soon = True
        self._owner_check = True  # the Node may have gone while the server was away
        delay = self.backoff.delay(self._in_a_row, jitter(self._rng))
        # The API server asked: a wrong kubeconfig or service host shows here.
        fields = _fields(
            server=self.api.server,
            error=_describe(error),
            retry_in=round(delay, 3),
            failures=self._in_a_row,
        )
        if isinstance(error, (*TRANSIENT_ERRORS, _Stale)):
            _log.warning("kube-api-unavailable", extra=fields)
        else:
            _log.error("resourceslice-publisher-failed", extra=fields, exc_info=error)
        await asyncio.sleep(delay)

    # -- the owner ---------------------------------------------------------------------

    async def _owner(self) -> str | None:
        """The Node's UID now (None: it does not exist), noting a change."""
        wanted = self._wanted
        assert wanted is not None
        uid = await self.api.node_uid(wanted.node_name)
        self._owner_check = False
        if uid is None:
            if self.node_present is not False:
                _log.warning(
                    "node-missing",
                    extra=_fields(
                        node=wanted.node_name,
                        detail="the Node does not exist: no ResourceSlices are written "
                        "until it is registered again",
                    ),
                )
            self.node_present = False
            self.synced = False
            return None
        if self._node_uid is not None and uid != self._node_uid:
            _log.warning(
                "node-replaced",
                extra=_fields(node=wanted.node_name, uid=uid, was=self._node_uid),
            )
        elif self.node_present is False:
            _log.info("node-registered", extra=_fields(node=wanted.node_name, uid=uid))
        self._node_uid = uid
        self.node_present = True
        return uid

    async def _await_node(self) -> None:
        """Until the Node exists: list it by name, and watch from the list."""
        wanted = self._wanted
        assert wanted is not None
        found = asyncio.Event()

        def seen(kind: str, node: object) -> None:
            if kind in ("ADDED", "MODIFIED"):
                found.set()

        while True:
            try:
                uid, version = await self.api.list_node(wanted.node_name)
            except ApiError as error:
                if not is_status(error, 403):
                    raise
                # An RBAC of an older dp: `get` only. Ask again and again.
                await self._poll_node()
                return
            if uid is not None:
                return
            period = self._rng.uniform(*self.watch_period)
            watch = asyncio.ensure_future(
                self.api.watch_node(wanted.node_name, version, period, seen)
            )
            appeared = asyncio.ensure_future(found.wait())
            try:
                await asyncio.wait({watch, appeared}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (watch, appeared):
                    task.cancel()
                await asyncio.gather(watch, appeared, return_exceptions=True)
            if watch.done() and not watch.cancelled() and watch.exception() is not None:
                raise watch.exception()  # type: ignore[misc]
            if found.is_set():
                return

    async def _poll_node(self) -> None:
        """Until the Node exists, reading it after 1 s, 2 s, ... up to 10 s."""
        wanted = self._wanted
        assert wanted is not None
        polls = Backoff(first=1.0, cap=10.0)
        tries = 0
        while await self.api.node_uid(wanted.node_name) is None:
            tries += 1
            await asyncio.sleep(polls.delay(tries, jitter(self._rng)))

    # -- a session ---------------------------------------------------------------------

    async def _session(self) -> None:
        """List, watch from the list, and keep the server's slices as wanted until
        something ends the watch, shows the view stale, or the Node goes (then
        the next session waits for it: nothing is written while it is gone)."""
        wanted = self._wanted
        assert wanted is not None
        if self.node_present is False:
            await self._await_node()
        # The Node is read at the first session and when it was missing; later
        # ones read it before a write, when something may have changed it.
        if (self._node_uid is None or self.node_present is False) and await self._owner() is None:
            return  # the next session waits for it
        loop = asyncio.get_running_loop()
        if self._probe_at() <= loop.time():
            await self._probe()
        items, self._version = await self.api.list_slices(wanted.node_name, wanted.driver)
        self._cache = SliceCache(items)
        watcher = asyncio.create_task(self._watch(), name="dp-resourceslice-watch")
        try:
            while True:
                self._changed.clear()
                if not await self._reconcile():
                    return  # the Node is gone
                self.synced = True
                self._in_a_row = 0
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait(
                        {changed, watcher},
                        timeout=max(0.0, self._probe_at() - loop.time()),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    changed.cancel()
                if watcher.done():
                    watcher.result()  # raises what ended the watch
                    raise _Stale  # pragma: no cover - the watch loop never returns
                if self._probe_at() <= loop.time():
                    await self._probe()  # a new finding changes the content
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    # -- what the cluster keeps --------------------------------------------------------

    def _probe_at(self) -> float:
        """When to ask (again) which DRA features the cluster keeps."""
        if self._learned_at is None:
            return 0.0
        if self._learn_soon:
            return self._learned_at + min(self.relearn, _PROBE_AFTER_FAILURE)
        return self._learned_at + self.relearn

    async def _probe(self) -> None:
        """Ask with a server-side dry run which DRA features the cluster keeps.

        Before the pool is first written: a cluster without a feature would
        store the pool without its fields, and the scheduler could split a
        group meanwhile. The answer goes to `on_features` when it is new."""
        wanted = self._wanted
        assert wanted is not None and self._node_uid is not None
        sent = probe_object(wanted, node_owner(wanted.node_name, self._node_uid))
        try:
            stored = await self.api.dry_run_slice(sent)
        except ApiError as error:
            if not is_status(error, *_PROBE_REFUSED):
                raise
            self._asked()
            _log.warning("dra-feature-probe-refused", extra=_fields(error=_describe(error)))
            if self._on_features is not None and len(self.features) < len(_GATES):
                self._on_features(DraFeaturesObserved(unknown=_describe(error)))
            return
        self._asked()
        self._report(features_kept(sent, stored))

    def _asked(self) -> None:
        self._learned_at = asyncio.get_running_loop().time()
        self._learn_soon = False
        self.probes += 1

    def _report(self, kept: dict[str, bool]) -> None:
        found = {f: k for f, k in kept.items() if self.features.get(f) != k}
        if not found:
            return
        self.features.update(found)
        if self._on_features is not None:
            self._on_features(DraFeaturesObserved(found.get(COUNTERS), found.get(TAINTS)))

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
            # The garbage collector takes the slices of a deleted Node: ask
            # whether it is still there before writing them again.
            self._owner_check = True
        else:
            self._cache.put(obj)
        if obj.metadata is not None and obj.metadata.resourceVersion:
            self._version = obj.metadata.resourceVersion
        self._changed.set()

    async def _reconcile(self) -> bool:
        """Make the server hold the wanted content; False when the Node is gone.

        A write while the content is what the server last held repairs an
        outside change, and waits for `repairs` (or for new content)."""
        loop = asyncio.get_running_loop()
        paced = False
        while True:
            wanted = self._wanted
            uid = self._node_uid
            assert wanted is not None and uid is not None
            owner = node_owner(wanted.node_name, uid)
            dropped = frozenset(f for f, kept in self.features.items() if not kept)
            top, plan = plan_pool(wanted, self._cache.values(), owner, dropped)
            if plan is None:
                self.generation = top
                self._held = wanted
                return True
            repair = wanted == self._held
            if repair and not paced:
                paced = True
                wait = self.repairs.not_before(loop.time()) - loop.time()
                if wait > 0:
                    self._new_content.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._new_content.wait(), wait)
                    continue  # the server, the content or the Node may have moved meanwhile
            if self._owner_check:
                now_uid = await self._owner()
                if now_uid is None:
                    return False
                if now_uid != uid:
                    continue  # owned by the new Node: every slice is written again
            if repair:
                self.repairs.wrote(loop.time())
            if await self._write(wanted, plan, owner, repair=repair):
                self._held = wanted
                return True

    async def _write(
        self, wanted: PoolContent, plan: Plan, owner: OwnerReference, *, repair: bool
    ) -> bool:
        """Carry out `plan`; False when what was learned changed the content."""
        count = plan.count

        async def write(index: int) -> tuple[ResourceSlice, ResourceSlice]:
            obj = plan.writes[index].object(wanted, plan.generation, count, owner)
            if obj.metadata is not None and obj.metadata.name:
                return obj, await self.api.replace_slice(obj)
            return obj, await self.api.create_slice(obj)

        # The slices of a generation go out together: a health change reaches
        # the scheduler once the last of them is written, and the scheduler
        # ignores a generation until it is complete.
        outcomes = await asyncio.gather(
            *(write(i) for i in range(len(plan.writes))), return_exceptions=True
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
            return False  # what was learned changed the content: start again with it
        for name in plan.deletes:
            await self.api.delete_slice(name)
            self._cache.deleted_by_us(name)
        self.generation = plan.generation
        _log.info(
            "resourceslices-published",
            extra=_fields(
                pool=wanted.pool,
                generation=plan.generation,
                slices=count,
                written=len(plan.writes),
                devices=len(wanted.devices),
                deleted=len(plan.deletes),
                repair=repair,
            ),
        )
        return True

    def _learn(self, sent: ResourceSlice, stored: ResourceSlice) -> None:
        """What a real write showed: it should agree with the dry run, unless the
        cluster changed since (or its API servers differ, as while they are
        upgraded one by one): then follow the write, and ask again in a minute."""
        kept = features_kept(sent, stored)
        if any(self.features.get(f) != k for f, k in kept.items()):
            self._learn_soon = True
        self._report(kept)

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
            "1 when the API server keeps a DRA feature's fields (a dry run, or the last "
            "write that had them, says), 0 when it drops them; absent until asked.",
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
        yield MetricFamily(
            "counter",
            "dp_dra_slice_repairs_total",
            "Writes of the pool that put back what outside changes undid (paced).",
            (Sample((), self.repairs.repairs),),
        )
        if self.node_present is not None:
            yield MetricFamily(
                "gauge",
                "dp_dra_node_present",
                "1 while this node's Node object exists, 0 while it does not (nothing is "
                "published then).",
                (Sample((), 1 if self.node_present else 0),),
            )


def _describe(error: BaseException) -> str:
    if isinstance(error, _Stale):
        return f"stale view: {error}"
    return describe(error)


def _fields(**fields: object) -> dict[str, dict[str, object]]:
    return {"dp_fields": fields}
