"""The README documents every flag of every command, as its users read it:
a row of a flag table per flag."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from nodesampler.cli import build_parser

README = Path(__file__).resolve().parent.parent / "README.md"


def flags() -> dict[str, set[str]]:
    """command -> its long flags."""
    parser = build_parser()
    [commands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: {o for a in sub._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
            for name, sub in commands.choices.items()}  # fmt: skip


def test_every_flag_of_every_command_has_a_row_in_the_readme() -> None:
    # A row's first cell, up to its first unescaped "|": "`--hz`, `--interval`"
    rows = re.findall(r"^\| (`--[^|]*?)(?<!\\)\|", README.read_text(), re.M)
    documented = {flag for cell in rows for flag in re.findall(r"`(--[a-z0-9-]+)", cell)}
    missing = {cmd: sorted(f - documented) for cmd, f in flags().items() if f - documented}
    assert not missing, f"flags with no row in README.md: {missing}"
    assert sum(len(f) for f in flags().values()) > 30  # the parser was read: every command has flags
