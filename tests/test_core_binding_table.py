"""The life cycle of one function's move to vfio-pci, row by row (binding.TRANSITIONS).

Each row is driven through `BindingBook`'s own API: a book is brought to the
row's state, the row's event happens, and the function's next state and the
outcome (BindDevice, UnbindDevice, its Move kept or dropped) are checked.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest

from dp_core import (
    VFIO_DRIVER,
    BindDevice,
    Binding,
    BindingBook,
    BindingFinished,
    Config,
    HostSnapshot,
    Move,
    PciAddress,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    UnbindDevice,
    UnbindingFinished,
    UsageError,
)
from dp_core.binding import TRANSITIONS, MoveEvent, MoveOutcome, MoveState

from core_builders import pci, snapshot

S, E, OUT = MoveState, MoveEvent, MoveOutcome

# (state, event) -> (next state, outcome): the table as it must read.
ROWS = [
    (S.IDLE, E.BIND_ASKED, S.BINDING, OUT.BIND_DEVICE),
    (S.BINDING, E.BIND_DONE, S.MOVED, OUT.MOVE_RECORDED),
    (S.BINDING, E.BIND_FAILED, S.IDLE, OUT.NOTHING),
    (S.BINDING, E.BIND_OUTLIVED, S.IDLE, OUT.NOTHING),
    (S.BINDING, E.BIND_WITHDRAWN, S.IDLE, OUT.NOTHING),
    (S.MOVED, E.BIND_ASKED, S.REBINDING, OUT.BIND_DEVICE),
    (S.REBINDING, E.BIND_DONE, S.MOVED, OUT.MOVE_RECORDED),
    (S.REBINDING, E.BIND_FAILED, S.MOVED, OUT.NOTHING),
    (S.REBINDING, E.BIND_WITHDRAWN, S.MOVED, OUT.NOTHING),
    (S.MOVED, E.GIVE_BACK_ASKED, S.GIVING_BACK, OUT.UNBIND_DEVICE),
    (S.GIVING_BACK, E.GIVE_BACK_ENDED, S.IDLE, OUT.MOVE_FORGOTTEN),
    (S.GIVING_BACK, E.GIVE_BACK_WITHDRAWN, S.MOVED, OUT.NOTHING),
    (S.REBINDING, E.GIVE_BACK_ASKED, S.GIVING_BACK_REBINDING, OUT.UNBIND_DEVICE),
    (S.GIVING_BACK_REBINDING, E.BIND_DONE, S.GIVING_BACK, OUT.MOVE_RECORDED),
    (S.GIVING_BACK_REBINDING, E.BIND_FAILED, S.GIVING_BACK, OUT.NOTHING),
    (S.GIVING_BACK_REBINDING, E.BIND_WITHDRAWN, S.GIVING_BACK, OUT.NOTHING),
    (S.GIVING_BACK_REBINDING, E.GIVE_BACK_ENDED, S.BINDING, OUT.MOVE_FORGOTTEN),
    (S.GIVING_BACK_REBINDING, E.GIVE_BACK_WITHDRAWN, S.REBINDING, OUT.NOTHING),
    (S.MOVED, E.DISOWNED, S.IDLE, OUT.MOVE_FORGOTTEN),
    (S.REBINDING, E.DISOWNED, S.BINDING, OUT.MOVE_FORGOTTEN),
    (S.GIVING_BACK, E.DISOWNED, S.GIVING_BACK_DISOWNED, OUT.MOVE_FORGOTTEN),
    (
        S.GIVING_BACK_REBINDING,
        E.DISOWNED,
        S.GIVING_BACK_DISOWNED_REBINDING,
        OUT.MOVE_FORGOTTEN,
    ),
    (S.GIVING_BACK_DISOWNED, E.GIVE_BACK_ENDED, S.IDLE, OUT.NOTHING),
    (S.GIVING_BACK_DISOWNED, E.GIVE_BACK_WITHDRAWN, S.IDLE, OUT.NOTHING),
    (S.GIVING_BACK_DISOWNED_REBINDING, E.BIND_DONE, S.GIVING_BACK, OUT.MOVE_RECORDED),
    (S.GIVING_BACK_DISOWNED_REBINDING, E.BIND_FAILED, S.GIVING_BACK_DISOWNED, OUT.NOTHING),
    (S.GIVING_BACK_DISOWNED_REBINDING, E.BIND_OUTLIVED, S.GIVING_BACK_DISOWNED, OUT.NOTHING),
    (S.GIVING_BACK_DISOWNED_REBINDING, E.BIND_WITHDRAWN, S.GIVING_BACK_DISOWNED, OUT.NOTHING),
    (S.GIVING_BACK_DISOWNED_REBINDING, E.GIVE_BACK_ENDED, S.BINDING, OUT.NOTHING),
    (S.GIVING_BACK_DISOWNED_REBINDING, E.GIVE_BACK_WITHDRAWN, S.BINDING, OUT.NOTHING),
    (S.IDLE, E.RECALLED, S.RECALLED, OUT.MOVE_RECALLED),
    (S.RECALLED, E.RECALL_CONFIRMED, S.MOVED, OUT.NOTHING),
    (S.RECALLED, E.RECALL_REFUTED, S.IDLE, OUT.MOVE_FORGOTTEN),
]

# Two NICs in IOMMU group 1: A is the function followed, B its sibling.
NIC = PciId(0x8086, 0x1572)
OTHER = PciId(0x10DE, 0x1234)
A = PciAddress.parse("0000:18:00.0")
B = PciAddress.parse("0000:18:00.1")
LOADED = frozenset({VFIO_DRIVER, "i40e"})
SELECTS_NIC = Config(
    PermittedHostDevices((PciHostDevice(NIC),)), shared_devices=(), binding=Binding(("i40e",))
)
SELECTS_OTHER = attrs.evolve(
    SELECTS_NIC, permitted_host_devices=PermittedHostDevices((PciHostDevice(OTHER),))
)


def host(a_driver: str | None = "i40e", *, with_a: bool = True) -> HostSnapshot:
    devices = [pci(str(B), NIC, 1, driver="i40e", class_code=0x020000)]
    if with_a:
        devices.insert(0, pci(str(A), NIC, 1, driver=a_driver, class_code=0x020000))
    return attrs.evolve(snapshot(devices), pci_drivers=LOADED)


Effects = list[object]


def ask_binds(book: BindingBook) -> Effects:
    """Plan from a scan showing both on i40e (before any move: stale once A moved)."""
    return list(book.replan(host(), SELECTS_NIC, start=True)[1])


def bind_ends(
    address: PciAddress,
    error: str | None = None,
    *,
    held: frozenset[int] = frozenset(),
    withdrawn: bool = False,
) -> Callable[[BindingBook], Effects]:
    def event(book: BindingBook) -> Effects:
        finished = BindingFinished(address, error, 0.0, withdrawn=withdrawn)
        return list(book.finished(finished, held))

    return event


def give_back_ends(**kw: bool) -> Callable[[BindingBook], Effects]:
    def event(book: BindingBook) -> Effects:
        return list(book.unbound(UnbindingFinished(A, None, 0.0, **kw)))

    return event


def disown(book: BindingBook) -> Effects:
    book.retry_all(host(), SELECTS_OTHER)  # the config stops selecting A (and B)
    return []


def outlive(book: BindingBook) -> Effects:
    book.retry_all(host(with_a=False), SELECTS_NIC)  # a scan sees A gone
    return bind_ends(A)(book)


def recall(book: BindingBook) -> Effects:
    book.recall([Move(A, "i40e", 1)])
    return []


def scanned(a_driver: str) -> Callable[[BindingBook], Effects]:
    def event(book: BindingBook) -> Effects:
        book.observed(host(a_driver))
        return []

    return event


EVENTS: dict[MoveEvent, Callable[[BindingBook], Effects]] = {
    E.BIND_ASKED: ask_binds,
    E.BIND_DONE: bind_ends(A),
    # An allocation holds the group, so a moved A is not given back at once:
    # the row alone shows (giving back follows, as in GIVE_BACK_ASKED).
    E.BIND_FAILED: bind_ends(A, "EIO", held=frozenset({1})),
    E.BIND_OUTLIVED: outlive,
    E.BIND_WITHDRAWN: bind_ends(A, withdrawn=True),
    E.GIVE_BACK_ASKED: bind_ends(B, "EIO"),  # the sibling's bind fails: the group is stuck
    E.GIVE_BACK_ENDED: give_back_ends(),
    E.GIVE_BACK_WITHDRAWN: give_back_ends(withdrawn=True),
    E.DISOWNED: disown,
    E.RECALLED: recall,
    E.RECALL_CONFIRMED: scanned(VFIO_DRIVER),
    E.RECALL_REFUTED: scanned("i40e"),
}

# How a fresh book gets A into each state, by the book's own inputs (B stays in flight).
SETUPS: dict[MoveState, list[Callable[[BindingBook], Effects]]] = {
    S.IDLE: [],
    S.BINDING: [ask_binds],
    S.MOVED: [ask_binds, bind_ends(A)],
    S.REBINDING: [ask_binds, bind_ends(A), ask_binds],
    S.GIVING_BACK: [ask_binds, bind_ends(A), bind_ends(B, "EIO")],
    S.GIVING_BACK_REBINDING: [ask_binds, bind_ends(A), ask_binds, bind_ends(B, "EIO")],
    S.GIVING_BACK_DISOWNED: [ask_binds, bind_ends(A), bind_ends(B, "EIO"), disown],
    S.GIVING_BACK_DISOWNED_REBINDING: [
        ask_binds,
        bind_ends(A),
        ask_binds,
        bind_ends(B, "EIO"),
        disown,
    ],
    S.RECALLED: [recall],
}


def book_in(state: MoveState) -> BindingBook:
    book = BindingBook()
    for step in SETUPS[state]:
        step(book)
    assert book.state(A) is state
    return book


def test_the_table_has_exactly_these_rows() -> None:
    assert dict(TRANSITIONS) == {(s, e): (after, outcome) for s, e, after, outcome in ROWS}


@pytest.mark.parametrize(
    ("state", "event", "after", "outcome"),
    ROWS,
    ids=[f"{s.value}--{e.value}" for s, e, _, _ in ROWS],
)
def test_row(state: MoveState, event: MoveEvent, after: MoveState, outcome: MoveOutcome) -> None:
    book = book_in(state)
    move_before = book.moved.get(A)
    version_before = book.moves_version
    effects = EVENTS[event](book)
    assert book.state(A) is after
    binds = [e for e in effects if isinstance(e, BindDevice) and e.address == A]
    unbinds = [e for e in effects if isinstance(e, UnbindDevice) and e.address == A]
    assert len(binds) == (outcome is OUT.BIND_DEVICE)
    assert len(unbinds) == (outcome is OUT.UNBIND_DEVICE)
    assert (A in book.in_flight) == (after.value.endswith("binding"))
    assert (A in book.giving_back) == after.value.startswith("giving-back")
    if outcome is OUT.MOVE_RECORDED:
        assert book.moved[A] == Move(A, "i40e", 1)
        assert book.moves_version > version_before
    elif outcome is OUT.MOVE_FORGOTTEN:
        assert A not in book.moved and move_before is not None
        assert book.moves_version > version_before
    elif outcome is OUT.MOVE_RECALLED:
        assert book.moved[A] == Move(A, "i40e", 1) and move_before is None
        assert book.moves_version == version_before  # already kept: nothing to report
    else:
        assert book.moved.get(A) is move_before


def test_a_give_back_that_ended_stays_leaving_until_a_scan() -> None:
    book = book_in(S.GIVING_BACK)
    give_back_ends()(book)
    assert A in book.leaving and book.state(A) is S.IDLE
    book.observed(host())
    assert A not in book.leaving


@pytest.mark.parametrize(
    ("state", "event"),
    [(s, e) for s in MoveState for e in MoveEvent if (s, e) not in TRANSITIONS],
    ids=lambda value: value.value,
)
def test_no_other_transition(state: MoveState, event: MoveEvent) -> None:
    book = book_in(state)
    with pytest.raises(UsageError, match="no transition"):
        book._step(A, event, Move(A, "i40e", 1))
    assert book.state(A) is state
