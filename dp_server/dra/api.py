"""The DRA front end's calls to the Kubernetes API, through lightkube, each one counted.

`KubeApi` is the only place that talks to the API server: it reads, lists
and watches this node's Node object (the owner of our ResourceSlices, which
may be deleted and registered again with a new UID), reads ResourceClaims
(and the Pod that owns a claim made for its extended resources),
and lists, watches, creates, replaces and deletes this node's ResourceSlices
of one driver. The request code and the object models are lightkube's; this module
only picks the calls, the field selectors and the timeouts, and counts every
request by verb and resource (`ApiCalls`), so /metrics and the benchmarks can
say how much dp asks of the API server.

Errors are lightkube's and httpx2's as they are (`ApiError` with the HTTP
status, `httpx2.HTTPError` for transport failures and timeouts): what to do
about them is the caller's decision (see `dp_server.dra.slices`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx2
from lightkube import ApiError, AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.config.models import Cluster, User
from lightkube.core.client import FieldSelector
from lightkube.core.exceptions import NotReadyError
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.events_v1 import Event
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from dp_core import MetricFamily, Sample

__all__ = [
    "ApiCalls",
    "ApiError",
    "KubeApi",
    "TRANSIENT_ERRORS",
    "WRITE_VERBS",
    "describe",
    "is_status",
]

#: What a request can fail with that a retry may cure: the API server's own
#: answers (`ApiError`) and anything on the way (refused, reset, timed out).
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (httpx2.HTTPError, OSError, TimeoutError)
# A dry run ("create-dry-run") is a request but writes nothing.
WRITE_VERBS = frozenset({"create", "update", "delete"})


def describe(error: BaseException) -> str:
    """An API request's failure in one line: the server's status, or what went wrong on the way."""
    if isinstance(error, ApiError):
        return f"{error.status.code} {error.status.reason}: {error.status.message}"
    return f"{type(error).__name__}: {error}"


def is_status(error: BaseException, *codes: int) -> bool:
    """Whether `error` is the API server answering with one of the HTTP `codes`."""
    return isinstance(error, ApiError) and error.status.code in codes


class ApiCalls:
    """Requests made, by (verb, resource); writes are create, update and delete."""

    def __init__(self) -> None:
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def count(self, verb: str, resource: str) -> None:
        self._counts[(verb, resource)] += 1

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    @property
    def writes(self) -> int:
        return sum(n for (verb, _), n in self._counts.items() if verb in WRITE_VERBS)

    def by_verb(self) -> dict[tuple[str, str], int]:
        return dict(self._counts)

    def families(self) -> Iterable[MetricFamily]:
        samples = tuple(
            Sample((("verb", verb), ("resource", resource)), n)
            for (verb, resource), n in sorted(self._counts.items())
        )
        yield MetricFamily(
            "counter",
            "dp_kube_api_requests_total",
            "Requests the DRA front end made to the Kubernetes API server, by verb and resource.",
            samples,
        )
        yield MetricFamily(
            "counter",
            "dp_kube_api_writes_total",
            "Creates, updates and deletes the DRA front end made to the Kubernetes API server.",
            (Sample((), self.writes),),
        )


def _version_of(listing: Any) -> str:
    """A list's resourceVersion; "" (watch from now) when the answer had none."""
    try:
        return str(listing.resourceVersion)
    except NotReadyError:
        return ""


def _slice_fields(node: str, driver: str) -> FieldSelector:
    return {"spec.nodeName": node, "spec.driver": driver}


class KubeApi:
    """This node's view of the API: its Node, its ResourceSlices of one driver, claims.

    Every request times out after `timeout` seconds (a watch: only while
    connecting; the server ends it after `timeoutSeconds`).
    """

    def __init__(
        self, client: AsyncClient, calls: ApiCalls | None = None, server: str = "(unknown)"
    ) -> None:
        self._client = client
        self.calls = calls if calls is not None else ApiCalls()
        self.server = server  # the API server's address, for the logs that say it is away

    @classmethod
    def connect(
        cls,
        *,
        kubeconfig: Path | None = None,
        server: str | None = None,
        timeout: float = 10.0,
        calls: ApiCalls | None = None,
    ) -> KubeApi:
        """A client for `server` (a URL), or the `kubeconfig` file's current context,
        or else the pod's service account. Nothing is sent until the first call."""
        if server is not None:
            # No credentials: a plain URL is a test's or a local proxy's.
            config = KubeConfig.from_one(cluster=Cluster(server=server), user=User())
        elif kubeconfig is not None:
            config = KubeConfig.from_file(kubeconfig)
        else:
            config = KubeConfig.from_service_account()
        client = AsyncClient(
            config, timeout=httpx2.Timeout(timeout), field_manager="dp", trust_env=False
        )
        current = config.get()
        return cls(client, calls, current.cluster.server if current else "(no current context)")

    async def close(self) -> None:
        await self._client.close()

    async def node_uid(self, name: str) -> str | None:
        """The UID of Node `name`; None when there is no such Node."""
        self.calls.count("get", "nodes")
        try:
            node = await self._client.get(Node, name)
        except ApiError as error:
            if error.status.code == 404:
                return None
            raise
        assert node.metadata is not None and node.metadata.uid is not None
        return node.metadata.uid

    async def list_node(self, name: str) -> tuple[str | None, str]:
        """The UID of Node `name` (None: there is none), and the resourceVersion to watch from."""
        listing = self._client.list(Node, fields={"metadata.name": name})
        self.calls.count("list", "nodes")
        uids = [n.metadata.uid async for n in listing if n.metadata is not None]
        return (uids[0] if uids else None), _version_of(listing)

    async def watch_node(
        self,
        name: str,
        resource_version: str,
        period: float,
        on_event: Callable[[str, Node], None],
    ) -> None:
        """Pass each change to Node `name` after `resource_version` to `on_event`, for
        `period` seconds (as `watch_slices`)."""
        await self._watch(
            Node, "nodes", {"metadata.name": name}, resource_version, period, on_event
        )

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        self.calls.count("get", "resourceclaims")
        claim: ResourceClaim = await self._client.get(ResourceClaim, name, namespace=namespace)
        return claim

    async def get_pod(self, namespace: str, name: str) -> Pod:
        """Pod `namespace/name`: the owner of a claim made for its extended
        resources, whose status maps that claim's requests to its containers."""
        self.calls.count("get", "pods")
        pod: Pod = await self._client.get(Pod, name, namespace=namespace)
        return pod

    async def list_slices(self, node: str, driver: str) -> tuple[list[ResourceSlice], str]:
        """This node's slices of `driver`, and the resourceVersion to watch from."""
        listing = self._client.list(ResourceSlice, fields=_slice_fields(node, driver))
        # One request per chunk; lightkube asks for no chunking, so one in all.
        self.calls.count("list", "resourceslices")
        items = [item async for item in listing]
        return items, _version_of(listing)

    async def watch_slices(
        self,
        node: str,
        driver: str,
        resource_version: str,
        period: float,
        on_event: Callable[[str, ResourceSlice], None],
    ) -> None:
        """Pass each change to this node's slices of `driver` after `resource_version` to
        `on_event` (ADDED, MODIFIED or DELETED, and the object), for `period` seconds.

        dp ends each watch itself after `period` (client-go's reflector does the
        same, with a random 5-10 minutes), so one watch is one request and a
        server that never closes cannot hold it forever. A 410 Gone (the version
        is too old) raises `ApiError` like any other failure; the caller lists again.
        """
        await self._watch(
            ResourceSlice,
            "resourceslices",
            _slice_fields(node, driver),
            resource_version,
            period,
            on_event,
        )

    async def _watch(
        self,
        kind: type[Any],
        resource: str,
        fields: FieldSelector,
        resource_version: str,
        period: float,
        on_event: Callable[[str, Any], None],
    ) -> None:
        self.calls.count("watch", resource)
        events = self._client.watch(kind, fields=fields, resource_version=resource_version or None)
        try:
            async with asyncio.timeout(period):
                async for change, obj in events:
                    on_event(change, obj)
        except TimeoutError:
            return
        finally:
            close = getattr(events, "aclose", None)  # lightkube's is an async generator
            if close is not None:
                await close()

    async def create_slice(self, obj: ResourceSlice) -> ResourceSlice:
        self.calls.count("create", "resourceslices")
        created: ResourceSlice = await self._client.create(obj)
        return created

    async def dry_run_slice(self, obj: ResourceSlice) -> ResourceSlice:
        """The slice as the server would store it (`?dryRun=All`): nothing is stored."""
        self.calls.count("create-dry-run", "resourceslices")
        answer: ResourceSlice = await self._client.create(obj, dry_run=True)
        return answer

    async def create_event(self, event: Event) -> None:
        """Record `event` (events.k8s.io/v1) in its namespace."""
        assert event.metadata is not None
        self.calls.count("create", "events")
        await self._client.create(event, namespace=event.metadata.namespace)

    async def replace_slice(self, obj: ResourceSlice) -> ResourceSlice:
        """An update with the object's resourceVersion as precondition (409 if stale)."""
        self.calls.count("update", "resourceslices")
        replaced: ResourceSlice = await self._client.replace(obj)
        return replaced

    async def delete_slice(self, name: str) -> None:
        """Delete `name`; one that is already gone (404) is what was wanted."""
        self.calls.count("delete", "resourceslices")
        try:
            await self._client.delete(ResourceSlice, name)
        except ApiError as error:
            if error.status.code != 404:
                raise
