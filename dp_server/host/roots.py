"""Whether `--sysfs` and `--dev` are roots of the kind they name.

A path that does not exist, one a level above the root (`fixtures/sysfs`
for `fixtures/sysfs/sys`), or one inside it (`/sys/bus`), reads as a host
with nothing on it. Each is said as a problem instead, naming the directory
that is such a root when there is one: the one the path is inside first,
else one right below it.
"""

from __future__ import annotations

import os

__all__ = ["root_problems"]

# Entries any sysfs has (a host without PCI still has bus/ and kernel/), and
# that any /dev has; a directory with none of them is not such a root.
_SYSFS = ("--sysfs", "/sys", ("bus", "kernel", "devices"))
_DEV = ("--dev", "/dev", ("null", "vfio", "kvm", "net"))
_LOOK_BELOW = 200  # entries of a directory looked at for a root one level down
_LOOK_ABOVE = 4  # directories above a path looked at for the root it is inside


def _is_root(path: str, marks: tuple[str, ...]) -> bool:
    return any(os.path.lexists(os.path.join(path, mark)) for mark in marks)


def _root_below(path: str, name: str, marks: tuple[str, ...]) -> str | None:
    """A directory right below `path` that is a root, the one called `name` first."""
    try:
        entries = sorted(os.listdir(path))[:_LOOK_BELOW]
    except OSError:
        return None
    entries.sort(key=lambda entry: entry != name)
    for entry in entries:
        child = os.path.join(path, entry)
        if os.path.isdir(child) and _is_root(child, marks):
            return child
    return None


def _root_above(path: str, marks: tuple[str, ...]) -> str | None:
    """The nearest directory above `path` that is plainly a root: it has at
    least two of the marks (a real one has them all, while a directory inside
    one, such as sysfs's bus/mdev with its `devices`, may have one)."""
    here = os.path.abspath(path)
    for _ in range(_LOOK_ABOVE):
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent
        if sum(os.path.lexists(os.path.join(here, mark)) for mark in marks) >= 2:
            return here if os.path.isabs(path) else os.path.relpath(here)
    return None


def _reason(path: str, flag: str, real: str, marks: tuple[str, ...]) -> str | None:
    what = f"{real} or a copy of it"
    if not os.path.exists(path):
        return f"does not exist; {flag} must be {what}"
    if not os.path.isdir(path):
        return f"is not a directory; {flag} must be {what}"
    above = _root_above(path, marks)
    if above is not None:
        return f"is inside {above}, which is {what}: did you mean {flag} {above}?"
    if _is_root(path, marks):
        return None
    below = _root_below(path, os.path.basename(real), marks)
    if below is not None:
        return f"is not {what}, but {below} is: did you mean {flag} {below}?"
    if real == "/dev":
        return None  # a copy of /dev may hold nothing yet: no node is there, and each says so
    return f"is not {what}: it has none of {', '.join(marks)}"


def root_problems(sysfs_root: str, dev_root: str) -> list[tuple[str, str]]:
    """(path, reason) for each of the two roots that is not what its flag must name."""
    problems = []
    for path, (flag, real, marks) in ((sysfs_root or "/", _SYSFS), (dev_root or "/", _DEV)):
        reason = _reason(path, flag, real, marks)
        if reason is not None:
            problems.append((path, reason))
    return problems
