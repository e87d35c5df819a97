"""Each README example that shows what `llmsim predict` or `llmsim size` prints prints it: the command of a bash block
is run and its output compared, line for line, with the block that follows it, up to that block's "...". (Four of
the five had drifted from what they printed before this test.)"""
from __future__ import annotations

import re
import shlex

import pytest

from llmsim.app.cli import main
from test_readme import README, _fenced_blocks


def _examples() -> list[tuple[str, list[str]]]:
    """(command, the lines shown) for every bash block running llmsim that an output block follows."""
    text = README.read_text()
    pairs = []
    for match in re.finditer(r"^```bash\n([^`]*?)^```\n```\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL):
        command = match.group(1).replace("\\\n", " ").strip()
        if not command.startswith("llmsim ") or "\n" in command:
            continue
        shown = match.group(2).splitlines()
        pairs.append((command, shown[:shown.index("...")] if "..." in shown else shown))
    return pairs


def test_the_readme_shows_examples_with_their_output():
    assert len(_examples()) >= 5 and len(_fenced_blocks(README.read_text())) > 5


@pytest.mark.parametrize("command,shown", _examples(), ids=lambda value: value[:40] if isinstance(value, str) else "")
def test_a_readme_example_prints_what_the_readme_shows(command, shown, capsys):
    assert main(shlex.split(command)[1:]) in (0, None)
    printed = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    assert printed[:len(shown)] == [line.rstrip() for line in shown]
