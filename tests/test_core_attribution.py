"""One-socket attribution against a model kubelet that knows the truth (docs/design.md §3, §4).

The model kubelet records which resource each connection it opens really
belongs to; the node never sees that. Hypothesis drives it through
registrations, refusals, lost connections and grpc-go's reconnections, and
the node must never serve a connection for another resource than its own,
and must end with every resource registered and watched.

Two kubelet generations are modelled:
- "options" (1.25 and later): dials inside Register and calls
  GetDevicePluginOptions there; ListAndWatch starts before or after the reply.
  Its connections can be lost at any time, and grpc-go reconnects for the
  next call. While it still holds a client for a resource (its stream not yet
  seen to end), a Register for that resource is answered at once without a
  dial, as 1.26 and later do ("already connected").
- "after-reply" (1.24 and earlier): dials after replying, starts with
  ListAndWatch. Nothing on the wire tells its reconnection from the next
  registration's dial, so the model does not lose its connections.
"""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
from hypothesis import given, settings

from dp_core import (
    AllocateRequested,
    AttributeConnection,
    ConnectionClosed,
    ConnectionOpened,
    Effect,
    EndStream,
    HostObserved,
    Input,
    KubeletStarted,
    OptionsRequested,
    Publish,
    Register,
    RegistrationFailed,
    RegistrationSucceeded,
    Reject,
    Reply,
    SocketMode,
    StandardNode,
    Tick,
    WatchStarted,
)
from dp_core.deviceplugin.registration import Phase

from core_builders import effects_of, gpu_config, two_gpus_and_vfs

GENERATIONS = ("options", "after-reply")


@attrs.define
class Endpoint:
    """The kubelet's client for one registration attempt."""

    register: Register
    connection: int | None = None  # None: not dialled yet, or lost (the next call reconnects)
    dialled: bool = False
    replied: bool = False
    stream: int | None = None
    broken: bool = False  # its stream's connection was lost; the kubelet has not noticed yet
    dead: bool = False


class ModelKubelet:
    def __init__(self, generation: str, data: st.DataObject | None) -> None:
        self.generation = generation
        self.data = data
        self.node = StandardNode(gpu_config(), socket_mode=SocketMode.SINGLE)
        self.now = 0.0
        self.next_id = 0
        self.truth: dict[int, str] = {}  # connection -> the resource it belongs to
        self.open: set[int] = set()
        self.stream_connection: dict[int, int] = {}
        self.pending: list[Endpoint] = []  # Register calls the kubelet is handling
        self.current: dict[str, Endpoint] = {}  # the registered endpoint of each resource
        self.held_replies = 0
        self.feed(HostObserved(two_gpus_and_vfs(), 0.0))
        self.feed(KubeletStarted(0.0))

    # -- plumbing ---------------------------------------------------------------------

    def fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    def feed(self, event: Input) -> list[Effect]:
        effects = self.node.handle(event)
        for bind in effects_of(effects, AttributeConnection):
            assert bind.resource == self.truth[bind.connection], (
                f"connection {bind.connection} of {self.truth[bind.connection]} "
                f"bound to {bind.resource}"
            )
        for publish in effects_of(effects, Publish):
            connection = self.stream_connection[publish.stream]
            assert publish.resource == self.truth[connection], (
                f"{publish.resource}'s devices sent on {self.truth[connection]}'s stream"
            )
        self.pending += [Endpoint(r) for r in effects_of(effects, Register)]
        for end in effects_of(effects, EndStream):
            self._stream_ended(end.stream)
        return effects

    def dial(self, resource: str) -> int:
        connection = self.fresh()
        self.truth[connection] = resource
        self.open.add(connection)
        self.feed(ConnectionOpened(connection, self.now))
        return connection

    def close(self, connection: int) -> None:
        if connection in self.open:
            self.open.discard(connection)
            self.feed(ConnectionClosed(connection, self.now))

    def connection_for(self, endpoint: Endpoint) -> int:
        """The endpoint's connection, reconnecting as grpc-go does if it was lost."""
        if endpoint.connection is None:
            endpoint.connection = self.dial(endpoint.register.resource)
        return endpoint.connection

    def _stream_ended(self, stream: int) -> None:
        # The kubelet closes the endpoint whose ListAndWatch ended, and waits
        # for the plugin to register again.
        for endpoint in [*self.pending, *self.current.values()]:
            if endpoint.stream == stream:
                self.kill(endpoint)

    def kill(self, endpoint: Endpoint) -> None:
        endpoint.dead = True
        if endpoint.connection is not None:
            self.close(endpoint.connection)
            endpoint.connection = None

    # -- the kubelet's handling of one Register ---------------------------------------

    def steps_of(self, endpoint: Endpoint) -> list[str]:
        """What the kubelet can do next for a Register it is handling."""
        if not endpoint.dialled:
            if self.generation == "after-reply" and not endpoint.replied:
                return ["reply", "refuse"]
            if self.holds_a_client(endpoint.register.resource):
                return ["held", "refuse"]
            return ["dial", "refuse"]
        steps = []
        if not endpoint.replied:
            steps.append("reply")
        if endpoint.stream is None and not endpoint.dead:
            steps.append("watch")
        return steps

    def advance(self, endpoint: Endpoint, step: str) -> None:
        resource, attempt = endpoint.register.resource, endpoint.register.attempt
        if step == "refuse":
            self.pending.remove(endpoint)
            self.feed(RegistrationFailed(resource, attempt, "refused", self.now))
        elif step == "dial":
            endpoint.dialled = True
            endpoint.connection = self.dial(resource)
            if self.generation != "options":
                self._replace(endpoint)
            else:
                effects = self.feed(OptionsRequested(endpoint.connection, self.fresh(), self.now))
                if effects_of(effects, Reject):
                    # GetDevicePluginOptions failed: so does the Register.
                    self.pending.remove(endpoint)
                    self.kill(endpoint)
                    self.feed(RegistrationFailed(resource, attempt, "options", self.now))
                    return
                self._replace(endpoint)
        elif step == "held":
            # connectClient finds the client it holds and replies at once.
            self.pending.remove(endpoint)
            endpoint.dead = True
            self.held_replies += 1
            self.feed(RegistrationSucceeded(resource, attempt, self.now))
        elif step == "reply":
            endpoint.replied = True
            self.feed(RegistrationSucceeded(resource, attempt, self.now))
        elif step == "watch":
            stream = self.fresh()
            endpoint.stream = stream
            self.stream_connection[stream] = self.connection_for(endpoint)
            self.feed(WatchStarted(self.stream_connection[stream], stream, self.now))
        if endpoint in self.pending and endpoint.replied and endpoint.stream is not None:
            self.pending.remove(endpoint)

    def holds_a_client(self, resource: str) -> bool:
        held = self.current.get(resource)
        return held is not None and not held.dead

    def _replace(self, endpoint: Endpoint) -> None:
        """The registration took: the resource's previous endpoint is stopped."""
        old = self.current.get(endpoint.register.resource)
        self.current[endpoint.register.resource] = endpoint
        if old is not None and old is not endpoint:
            self.kill(old)

    # -- random steps -------------------------------------------------------------------

    def draw_step(self) -> None:
        assert self.data is not None
        draw = self.data.draw
        # A kubelet that says nothing on its new connection, or dials after
        # replying, makes its first call within the dial wait (3 s): later,
        # the timing rule cannot tell it from the next registration's.
        quiet = any(e.stream is None and (e.dialled or e.replied) for e in self.pending)
        slow = [] if quiet and self.generation != "options" else [4.0]
        self.now += draw(st.sampled_from([0.0, 0.0, 0.01, 0.5, *slow]))
        losses = ["lose", "lose", "notice"] if self.generation == "options" else []
        choice = draw(st.sampled_from(["tick", "allocate", *losses] + ["register"] * 4))
        if choice == "register" and self.pending:
            endpoint = draw(st.sampled_from(self.pending))
            steps = self.steps_of(endpoint)
            if steps:
                self.advance(endpoint, draw(st.sampled_from(steps)))
        elif choice == "lose":
            connections = sorted(self.open)
            if connections:
                self.lose(draw(st.sampled_from(connections)))
        elif choice == "notice":
            broken = [e for e in self.current.values() if e.broken and not e.dead]
            if broken:
                self.kill(draw(st.sampled_from(broken)))
        elif choice == "allocate":
            ready = [e for e in self.current.values() if e.replied and not e.dead]
            ready = [e for e in ready if e.dialled]
            if ready:
                self.allocate(draw(st.sampled_from(ready)))
        else:
            self.feed(Tick(self.now))

    def lose(self, connection: int) -> None:
        """The transport closes under the kubelet; a stream on it breaks."""
        self.close(connection)
        for endpoint in [*self.pending, *self.current.values()]:
            if endpoint.connection == connection:
                endpoint.connection = None
                if endpoint.stream is not None:
                    endpoint.broken = True

    def allocate(self, endpoint: Endpoint) -> None:
        resource = endpoint.register.resource
        devices = [d.id for d in self.node.device_plugin.advertised(resource) if d.healthy]
        if not devices:
            return
        connection = self.connection_for(endpoint)
        call = self.fresh()
        effects = self.feed(AllocateRequested(connection, call, [(devices[0],)], self.now))
        answered = [e for e in effects if isinstance(e, Reply | Reject) and e.call == call]
        assert len(answered) == 1

    def settle(self) -> None:
        """No more losses: the kubelet handles each Register as it comes, and time passes."""
        for endpoint in [*self.current.values()]:
            if endpoint.broken:
                self.kill(endpoint)
        for _ in range(200):
            if self.node.device_plugin.registrar.settled() and not self.pending:
                return
            if self.pending:
                endpoint = self.pending[0]
                steps = [s for s in self.steps_of(endpoint) if s != "refuse"]
                if steps:
                    self.advance(endpoint, steps[0])
                    continue
                self.pending.remove(endpoint)
            self.now += 1.0
            self.feed(Tick(self.now))
        raise AssertionError(f"never settled: {self.node.device_plugin.registrar.phases()}")


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(GENERATIONS), st.data())
def test_connections_are_only_ever_served_for_their_own_resource(
    generation: str, data: st.DataObject
) -> None:
    kubelet = ModelKubelet(generation, data)
    for _ in range(data.draw(st.integers(0, 80))):
        kubelet.draw_step()
    kubelet.settle()
    registrar = kubelet.node.device_plugin.registrar
    for resource in kubelet.node.device_plugin.resource_names():
        assert registrar.phases()[resource] is Phase.LIVE
        endpoint = kubelet.current[resource]
        assert not endpoint.dead and endpoint.connection is not None
        assert registrar.owner(endpoint.connection) == resource
        assert endpoint.stream in kubelet.node.device_plugin.streams(resource)
