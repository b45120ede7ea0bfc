"""Moving selected functions to vfio-pci and back (docs/design.md §6): the
plan (`plan`), the life cycle of each move as a table (`book`), what dp
moved (`moves`), and the node's part in it (`binder`)."""

from .binder import Binder
from .book import TRANSITIONS, BindingBook, MoveEvent, MoveState, Outcome
from .events import (
    BindDevice,
    BindingFinished,
    MovesChanged,
    MovesRecalled,
    UnbindDevice,
    UnbindingFinished,
)
from .moves import Move
from .plan import BindDecision, plan_bindings, selected_for_binding

__all__ = [
    "TRANSITIONS",
    "BindDecision",
    "BindDevice",
    "Binder",
    "BindingBook",
    "BindingFinished",
    "Move",
    "MoveEvent",
    "MoveState",
    "MovesChanged",
    "MovesRecalled",
    "Outcome",
    "UnbindDevice",
    "UnbindingFinished",
    "plan_bindings",
    "selected_for_binding",
]
