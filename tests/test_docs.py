"""What the README and docs tell a newcomer to run, and what they cite, hold."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
CI = (REPO / ".ci" / "run").read_text()


def _first_commands() -> list[str]:
    block = README.split("```sh\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_the_readme_commands_make_and_use_a_virtual_environment() -> None:
    """PEP 668: a distribution's python3 refuses `pip install`, so each command
    makes .venv itself and runs only what it installed there."""
    install, test = _first_commands()
    for command in (install, test):
        assert command.startswith("python3 -m venv .venv && "), command
        steps = command.split(" && ")[1:]
        assert steps and all(step.startswith(".venv/bin/") for step in steps), command
    assert install.endswith(" && .venv/bin/dp-server demo")
    assert test.endswith(" && .venv/bin/python -m pytest")


def test_ci_runs_the_readme_commands_as_written() -> None:
    install, test = _first_commands()
    assert f'readme_install_command="{install}"' in CI
    assert f'readme_test_command="{test}"' in CI
    assert 'eval "$readme_test_command"' in CI
    # And the install on Debian's own python3, which PEP 668 guards.
    assert re.search(r'ln -s /usr/bin/python3 "\$scratch/bin/python3"', CI)
    assert 'eval "$readme_install_command"' in CI


# --- links between the docs --------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    skip = {".git", ".venv", "venv", "node_modules", "build", "dist"}
    return sorted(
        path
        for path in REPO.rglob("*.md")
        if not skip & set(path.relative_to(REPO).parts) and "egg-info" not in str(path)
    )


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    import unicodedata

    text = heading.strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_every_link_between_the_docs_reaches_a_file_and_a_heading() -> None:
    broken = []
    for doc in _markdown_files():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path_part, _, anchor = target.partition("#")
            linked = (doc.parent / path_part).resolve() if path_part else doc
            if not linked.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert broken == []


# --- code the docs cite ------------------------------------------------------------------

# A repository path as the docs write it: under one of the project's own
# top-level directories, not preceded by a `/` (a host path such as
# /sys/bus/pci is no citation). Placeholders (`<group>`, `*`) are not paths.
_CITED_PATH = re.compile(
    r"(?<![\w./-])((?:dp_core|dp_server|dp_testing|tests|bench|examples|deploy|scripts"
    r"|fixtures|protos|docs|\.ci)/[\w./*<>{}-]*)"
)
_CITED_NAME = re.compile(r"(?<![\w./-])((?:dp_core|dp_server|dp_testing)(?:\.\w+)+)")


def _resolves(dotted: str) -> bool:
    """A dotted name is a module, or an attribute of the longest importable prefix."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def _bad_citations(text: str) -> list[str]:
    bad = []
    for match in _CITED_PATH.finditer(text):
        path = match.group(1).rstrip(".,:;")
        if not re.search(r"[*<>{}]", path) and not (REPO / path).exists():
            bad.append(f"{path} (no such file)")
    for match in _CITED_NAME.finditer(text):
        if not _resolves(match.group(1)):
            bad.append(f"{match.group(1)} (does not import)")
    return bad


def test_every_code_path_and_dotted_name_the_docs_cite_exists() -> None:
    bad = [
        f"{doc.relative_to(REPO)}: {citation}"
        for doc in _markdown_files()
        for citation in _bad_citations(doc.read_text())
    ]
    assert bad == []


def test_a_stale_citation_is_caught() -> None:
    text = (
        "The scanner (`dp_server/host/scanner.py`) and `dp_core.config.names.resource_name_error`"
        " hold; `dp_core/cdi.py` moved, `tests/test_nothing_here.py` never was, and"
        " `dp_core.names.resource_name_error` and `dp_core.config.names.nothing` do not import."
        " /sys/bus/pci/devices and `dp_core/<module>.py` are no citations."
    )
    assert _bad_citations(text) == [
        "dp_core/cdi.py (no such file)",
        "tests/test_nothing_here.py (no such file)",
        "dp_core.names.resource_name_error (does not import)",
        "dp_core.config.names.nothing (does not import)",
    ]


# --- the test command's own last line ------------------------------------------------------


@pytest.mark.parametrize("flags", [[], ["-q"]], ids=["as-the-readme", "-q"])
def test_the_test_command_ends_with_its_summary_line(tmp_path: Path, flags: list[str]) -> None:
    """The project's pytest settings leave the `N passed` line to every way
    the docs run the suite, with or without a -q of its own."""
    import sys

    (tmp_path / "test_one.py").write_text("def test_one() -> None:\n    assert True\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml")]
        + ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), *flags]
        + [str(tmp_path / "test_one.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"^=*\s*1 passed in [\d.]+s", result.stdout, re.M), result.stdout


# --- the examples' own words ------------------------------------------------------------


def _commented_commands(path: Path) -> list[list[str]]:
    """The `dp-server ...` commands a file's comments tell the reader to run."""
    commands, current = [], ""
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").rstrip()
        if not line.startswith("#") or not (current or text.startswith("dp-server ")):
            continue
        current += " " + text.rstrip("\\")
        if not text.endswith("\\"):
            commands.append(current.split()[1:])
            current = ""
    return commands


def test_the_commands_in_the_examples_comments_run_as_written(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dp_server.cli.main import main

    monkeypatch.chdir(REPO)
    ran = 0
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for argv in _commented_commands(path):
            if argv[0] == "scan":  # `demo --config` is run for every example in test_cli
                assert main(argv) == 0, (path.name, argv)
                assert "problems reading the host" not in capsys.readouterr().out, argv
                ran += 1
    assert ran >= 2


def test_the_binding_example_warns_first_about_the_network_interface_it_unbinds() -> None:
    """Every network function the example moves is named in the warning it opens with."""
    from dp_core import plan_bindings
    from dp_server.config.loader import load_config
    from dp_testing.topology import fixture_topology, to_snapshot

    path = REPO / "examples" / "config-binding.yaml"
    header = path.read_text().split("\n\n", 1)[0]
    assert header.startswith("# WARNING: THIS CONFIG UNBINDS A NETWORK INTERFACE.")
    snapshot = to_snapshot(fixture_topology())
    moved = [
        snapshot.device(address)
        for address, decision in plan_bindings(snapshot, load_config(path)).items()
        if decision.binds
    ]
    network = [pci for pci in moved if pci is not None and pci.class_code >> 16 == 0x02]
    assert network
    for pci in network:
        assert f"{pci.vendor:04X}:{pci.device:04X}" in header and pci.driver in header


def test_design_citations_name_sections_of_docs_design_md() -> None:
    """The code and docs cite the project's own design document, by section."""
    sections = {
        int(number)
        for number in re.findall(r"^## (\d+)\. ", (REPO / "docs" / "design.md").read_text(), re.M)
    }
    assert sections == set(range(1, len(sections) + 1))
    cited: list[tuple[str, int]] = []
    for path in _tracked_files():
        if path.suffix not in (".py", ".md", ".yaml", ".go"):
            continue
        text = path.read_text(errors="replace")
        # A section is cited only of the project's own design document, never
        # of one a user of the repository does not have.
        documents = set(re.findall(r"([\w./-]*\.md)\b[^\u00a7\n]{0,3}\u00a7", text))
        assert documents <= {"docs/design.md"}, (path, documents)
        for numbers in re.findall(
            r"design\.md[^\u00a7\n]{0,40}\u00a7(\d+(?:[–,-] ?\u00a7?\d+)*)", text
        ):
            cited += [(str(path), int(n)) for n in re.findall(r"\d+", numbers)]
    assert len(cited) >= 30
    assert [c for c in cited if c[1] not in sections] == []


def _tracked_files() -> list[Path]:
    """The repository's own files: what git tracks, not build output or a venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    return [REPO / name for name in listed.split("\0") if name and (REPO / name).is_file()]
