"""dp_core stays pure: no I/O imports, strict typing, frozen inputs and effects.

The import check is an AST walk, so it sees `import x`, `from x import y`,
`from x.sub import y`, `importlib.import_module("x")` and `__import__("x")`
without importing anything.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import dp_core
from dp_core import effects as effects_module
from dp_core import inputs as inputs_module
from dp_core.deviceplugin import answers as answers_module
from dp_core.dra.pool_content import PoolContent

REPO = Path(__file__).resolve().parent.parent
CORE_DIR = REPO / "dp_core"
CORE_MODULES = sorted(CORE_DIR.rglob("*.py"))

FORBIDDEN = frozenset(
    {
        "asyncio",
        "socket",
        "os",
        "pathlib",
        "time",
        "random",
        "threading",
        "subprocess",
        "grpclib",
        "betterproto",
        "betterproto2",
        "watchfiles",
        "logging",
        "importlib",
    }
)


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def forbidden_imports(source: str) -> list[str]:
    """Every forbidden module `source` imports, statically or dynamically."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _top(alias.name) in FORBIDDEN]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and _top(node.module) in FORBIDDEN:
                found.append(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module"
            )
            if dynamic:
                target = node.args[0] if node.args else None
                if isinstance(target, ast.Constant) and isinstance(target.value, str):
                    found.append(f"dynamic import of {target.value}")
                else:
                    found.append("dynamic import of a computed name")
    return found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os", ["os"]),
        ("import os.path as p", ["os.path"]),
        ("from os import path", ["os"]),
        ("from pathlib import Path", ["pathlib"]),
        ("import re, time", ["time"]),
        ("from asyncio.events import AbstractEventLoop", ["asyncio.events"]),
        ("import betterproto2", ["betterproto2"]),
        ("from grpclib.server import Server", ["grpclib.server"]),
        ("def f():\n    import random\n", ["random"]),
        ("import importlib\nimportlib.import_module('x')", ["importlib", "dynamic import of x"]),
        ("m = __import__('socket')", ["dynamic import of socket"]),
        ("m = __import__(name)", ["dynamic import of a computed name"]),
        ("import re\nimport attrs\nfrom .pci import PciId", []),
        ("from . import os", []),  # a sibling module called os is not the os module
        ("import osmosis", []),
        ("import logging_helpers", []),
    ],
)
def test_forbidden_import_detector(source: str, expected: list[str]) -> None:
    assert forbidden_imports(source) == expected


def _name(path: Path) -> str:
    return path.relative_to(CORE_DIR).as_posix()


def test_core_modules_are_found() -> None:
    names = {_name(path) for path in CORE_MODULES}
    assert {
        "node.py",
        "deviceplugin/registration.py",
        "deviceplugin/allocations.py",
        "inventory/build.py",
        "inputs.py",
        "dra/frontend.py",
    } <= names


@pytest.mark.parametrize("path", CORE_MODULES, ids=_name)
def test_core_module_imports_nothing_impure(path: Path) -> None:
    assert forbidden_imports(path.read_text(encoding="utf-8")) == []


def test_mypy_strict_passes_on_dp_core(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-error-summary",
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "dp_core",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", dp_core.__all__)
def test_public_name_exists(name: str) -> None:
    assert getattr(dp_core, name, None) is not None


def test_all_has_no_duplicates() -> None:
    assert len(dp_core.__all__) == len(set(dp_core.__all__))


def _frozen_classes(module: object) -> list[type]:
    names: list[str] = module.__all__  # type: ignore[attr-defined]
    classes = [getattr(module, name) for name in names]
    return [cls for cls in classes if isinstance(cls, type) and attrs.has(cls)]


INPUT_CLASSES = _frozen_classes(inputs_module)
EFFECT_CLASSES = _frozen_classes(effects_module)


def test_every_input_and_effect_is_an_attrs_class() -> None:
    input_names = {cls.__name__ for cls in INPUT_CLASSES}
    effect_names = {cls.__name__ for cls in EFFECT_CLASSES}
    assert input_names == {name for name in inputs_module.__all__ if name != "Input"}
    assert effect_names == {
        name for name in effects_module.__all__ if name not in ("Answer", "Effect")
    }


def _sample(cls: type) -> object:
    """An instance of `cls` with plausible values for every field."""
    values: dict[str, object] = {}
    for field in attrs.fields(cls):
        if not field.init or field.default is not attrs.NOTHING:
            continue
        values[field.alias or field.name] = _value_for(field.name)
    return cls(**values)


def _value_for(field_name: str) -> object:
    samples: dict[str, object] = {
        "snapshot": dp_core.HostSnapshot(),
        "config": dp_core.Config(),
        "now": 1.0,
        "resource": "example.com/r",
        "attempt": 1,
        "reason": "why",
        "connection": 1,
        "call": 1,
        "stream": 1,
        "available": ("a",),
        "must_include": (),
        "size": 1,
        "containers": (),
        "device_ids": ("a",),
        "held": {"example.com/r": frozenset({"a"})},
        "endpoint": "dp.sock",
        "options": dp_core.PluginOptions(),
        "devices": (),
        "answer": dp_core.PreStartAnswer(),
        "status": dp_core.StatusCode.UNAVAILABLE,
        "message": "no",
        "device_id": "a",
        "healthy": True,
        "wanted": True,
        "level": "info",
        "event": "e",
        "container_path": "/dev/x",
        "host_path": "/dev/x",
        "permissions": "rw",
        "address": dp_core.PciAddress.parse("0000:18:00.0"),
        "driver": "i40e",
        "error": None,
        "checkpoint": dp_core.KubeletCheckpoint(),
        "in_place": (),
        "problem": "it failed",
        "moves": (),
        "claim": dp_core.ClaimRef("default", "uid-1", "vm"),
        "results": (),
        "prepared": (),
        "specs": (),
        "content": PoolContent("vfio.dp.example.com", "node-a", "node-a"),
        "at": 1.0,
        "valid_for": 31,
        "write": dp_core.BindDevice(dp_core.PciAddress.parse("0000:18:00.0"), "i40e"),
        "carry_out": True,
    }
    return samples[field_name]


@pytest.mark.parametrize("cls", INPUT_CLASSES + EFFECT_CLASSES, ids=lambda cls: cls.__name__)
def test_inputs_and_effects_are_frozen(cls: type) -> None:
    instance = _sample(cls)
    fields = attrs.fields(cls)
    name = fields[0].name if fields else "extra"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(instance, name, getattr(instance, name, None))
    # Hashable and equal to a copy, as frozen values must be.
    assert instance == attrs.evolve(instance)


ANSWER_CLASSES = _frozen_classes(answers_module)


def test_every_answer_is_an_attrs_class() -> None:
    assert {cls.__name__ for cls in ANSWER_CLASSES} == {
        name for name in answers_module.__all__ if name != "Answer"
    }


@pytest.mark.parametrize("cls", ANSWER_CLASSES, ids=lambda cls: cls.__name__)
def test_answers_are_frozen(cls: type) -> None:
    instance = _sample(cls)
    fields = attrs.fields(cls)
    if fields:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(instance, fields[0].name, getattr(instance, fields[0].name))
    assert instance == attrs.evolve(instance)
    hash(instance)


def test_a_move_is_frozen_and_checks_its_driver() -> None:
    address = dp_core.PciAddress.parse("0000:18:00.0")
    move = dp_core.Move(address, "i40e", 18)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        move.driver = "ixgbe"  # type: ignore[misc]
    with pytest.raises(ValueError):
        dp_core.Move(address, "../bind", 18)


@pytest.mark.parametrize(
    "instance",
    [
        dp_core.HostSnapshot(),
        dp_core.PciAddress.parse("0000:3b:00.0"),
        dp_core.AdvertisedDevice("a", True),
        dp_core.Resource("example.com/r", dp_core.DeviceKind.PCI, ()),
        dp_core.Config(),
    ],
    ids=lambda instance: type(instance).__name__,
)
def test_core_values_are_frozen(instance: object) -> None:
    first = attrs.fields(type(instance))[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(instance, first, None)


def test_input_id_lists_are_copied_into_tuples() -> None:
    ids = ["a", "b"]
    event = dp_core.PreStartRequested(1, 1, ids, 0.0)
    ids.append("c")
    assert event.device_ids == ("a", "b")
    held = {"example.com/r": {"a"}}
    observed = dp_core.AllocationsObserved(held, 0.0)  # type: ignore[arg-type]
    held["example.com/r"].add("b")
    assert observed.held["example.com/r"] == frozenset({"a"})
    with pytest.raises(TypeError):
        observed.held["other"] = frozenset()  # type: ignore[index]
