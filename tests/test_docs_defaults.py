"""Every default the docs state is the parser's: the README's flag table of
each command against `build_parser()`, each `--help` line's "(default X)"
against the same, and the defaults the other docs repeat (docs/metrics.md's
forgetting, the unit's memory in tests/test_deploy.py, the alerts' timing in
tests/test_alerts.py). A table cell that is prose (computed at run time) is
listed here by name, so a new one is seen."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from nodesampler.cli.parser import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

# Cells that describe a default found at run time, not a value.
PROSE = {
    ("sample", "--kubelet-url"), ("sample", "--kubelet-token-file"), ("sample", "--kubelet-ca-file"),
    ("agent", "--ca-file"), ("agent", "--node"), ("controlplane", "--k8s-issuer"),
    ("controlplane", "--incidents-dir"), ("controlplane", "--peer-secret-file"), ("controlplane", "--peer-ca-file"),
    ("up", "--state-dir"), ("up", "--state-file"), ("up", "--incidents-dir"), ("up", "--ca-file"),
}  # fmt: skip


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def readme_rows() -> list[tuple[str, str, str]]:
    """(command, flag, its default cell) for every row of every command's table."""
    rows = []
    sections = re.split(r"^### `nodesampler ([\w-]+)`", README, flags=re.M)
    for command, body in zip(sections[1::2], sections[2::2], strict=True):
        for names, cell in re.findall(r"^\| (`--[^|]*?) \| ([^|]*?) \| ", body, re.M):
            flags = re.findall(r"`(--[\w-]+)[^`]*`", names)
            cells = [c.strip() for c in cell.split(",")] if len(flags) > 1 and "," in cell else [cell.strip()] * len(
                flags)  # fmt: skip
            rows += [(command, flag, cells[i]) for i, flag in enumerate(flags)]
    return rows


def test_every_readme_default_is_the_parser_s() -> None:
    commands = subcommands()
    rows = readme_rows()
    assert {c for c, _, _ in rows} == {"sample", "agent", "controlplane", "forget", "token", "up"} - {"token"}
    for command, flag, cell in rows:
        actions = {o: a for a in commands[command]._actions for o in a.option_strings}
        assert flag in actions, f"README names {command} {flag}, which the parser does not take"
        action = actions[flag]
        where = f"{command} {flag}: README says {cell!r}, the parser {action.default!r}"
        if (command, flag) in PROSE:
            assert action.default in (None, []), where
        elif cell == "required" or cell.startswith("required "):
            assert action.required or (command, flag) == ("controlplane", "--k8s-issuer"), where
        elif cell == "none":
            assert action.default in (None, []) and not action.required, where
        elif cell == "off":
            assert action.default is False, where
        elif m := re.fullmatch(r"(-?[\d.]+)( \(.*\))?", cell):
            assert float(m[1]) == float(action.default), where
        elif m := re.fullmatch(r"`([^`]*)`", cell):
            assert str(action.default) == m[1], where
        else:
            pytest.fail(f"{command} {flag}: a default cell this test cannot read: {cell!r}")


def test_every_flag_is_in_its_command_s_readme_section() -> None:
    sections = dict(zip(*[iter(re.split(r"^### `nodesampler ([\w-]+)`", README, flags=re.M)[1:])] * 2, strict=True))
    for command, parser in subcommands().items():
        body = sections[command]
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or not action.option_strings or "--help" in action.option_strings:
                continue
            flag = max(action.option_strings, key=len)
            prefixes = re.findall(r"`(--[\w-]+-)\*`", body)  # `--kubelet-*`
            assert flag in body or flag.startswith(tuple(prefixes)), f"{command} {flag} is not in its README section"


def test_every_help_default_is_the_parser_s() -> None:
    for command, parser in subcommands().items():
        for action in parser._actions:
            said = re.search(r"\(default:? ([^)]*)\)", action.help or "")
            if said is None:
                continue
            text = re.split(r"[;:] ", said[1])[0]  # "15; 0: none kept", "604800: a week"
            value = action.default
            if value in (None, []) and text not in ("none", "off"):
                continue  # prose: a default found at run time ("$NODE_NAME, else the host name")
            where = f"{command} {action.option_strings}: --help says {text!r}, the parser {value!r}"
            if re.fullmatch(r"-?[\d.]+", text):
                assert float(text) == float(value), where
            elif text in ("none", "off"):
                assert value in (None, [], False), where
            else:
                assert text == str(value), where


def test_the_forgetting_the_metrics_doc_states_is_the_parser_s() -> None:
    forget_after = {o: a for a in subcommands()["controlplane"]._actions for o in a.option_strings}["--forget-after"]
    assert forget_after.default == 7 * 24 * 3600
    metrics = (ROOT / "docs" / "metrics.md").read_text()
    said = re.search(r"A node silent for `--forget-after` \((\w+ \w+)\) is gone", metrics)
    assert said is not None and said[1] == "a week"
    assert "(default 604800: a week)" in (forget_after.help or "")
