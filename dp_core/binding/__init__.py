"""Moving selected functions to vfio-pci and back (docs/design.md §6): the
plan (`plan`), the life cycle of each move as a table (`book`), what dp
moved (`moves`), and the node's part in it (`binder`)."""

from .book import TRANSITIONS, BindingBook, MoveEvent, MoveOutcome, MoveState
from .events import (
    BindDevice,
    BindingFinished,
    MovesChanged,
    MovesRecalled,
    UnbindDevice,
    UnbindingFinished,
    WriteDecided,
    WriteDue,
)
from .moves import Move
from .plan import BindDecision, plan_bindings, selected_for_binding
from .planner import BindingPlanner

__all__ = [
    "TRANSITIONS",
    "BindDecision",
    "BindDevice",
    "BindingPlanner",
    "BindingBook",
    "BindingFinished",
    "Move",
    "MoveEvent",
    "MoveState",
    "MovesChanged",
    "MovesRecalled",
    "MoveOutcome",
    "UnbindDevice",
    "UnbindingFinished",
    "WriteDecided",
    "WriteDue",
    "plan_bindings",
    "selected_for_binding",
]
