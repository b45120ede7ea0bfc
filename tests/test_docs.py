"""What the README and docs tell a newcomer to run, and what they cite, hold."""

from __future__ import annotations

import re
from pathlib import Path

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
