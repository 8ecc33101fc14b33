"""The accuracy lines of a `make vm-test` guest as rows of its table: the
worst error of each comparison against its bound. Reads the JSON lines the
kernel tests appended (tests/conftest.py AccuracyLog) on standard input."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable


def worst_by_check(lines: Iterable[str]) -> dict[str, dict[str, float]]:
    worst: dict[str, dict[str, float]] = {}
    for line in lines:
        if not line.strip():
            continue
        r = json.loads(line)
        if r["check"] not in worst or r["error"] > worst[r["check"]]["error"]:
            worst[r["check"]] = r
    return worst


def rows(worst: dict[str, dict[str, float]]) -> list[str]:
    out = []
    for check, r in worst.items():
        error, bound = r["error"], r["bound"]
        verdict = "within" if error <= bound else "OUTSIDE"
        out.append(f"{check:<38} worst {error:6.2%}  {verdict} {bound:.0%}")
    return out


if __name__ == "__main__":
    for row in rows(worst_by_check(sys.stdin)):
        print("    " + row)
