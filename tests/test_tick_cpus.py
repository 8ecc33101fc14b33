"""Which CPUs get the kernel backend's cpu-clock tick: every online CPU but
those the operator keeps free of ticks (nohz_full) or of the scheduler
(isolcpus), read from sysfs as the kernel writes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from sampler.sources.cpu_lists import parse_cpu_list, tick_cpus


@pytest.mark.parametrize("text, cpus", [
    ("0-3\n", [0, 1, 2, 3]), ("0,2,4-5\n", [0, 2, 4, 5]), ("\n", []), ("7", [7]), ("0-1,1-2", [0, 1, 2]),
    (b"0-3,8,10-11\n", [0, 1, 2, 3, 8, 10, 11]),
])  # fmt: skip
def test_cpu_lists(text: str | bytes, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["a", "1-b", "-3", "1--2", "(null)"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cpu_list(text)


def sysfs(tmp_path: Path, **files: str) -> Path:
    d = tmp_path / "devices" / "system" / "cpu"
    d.mkdir(parents=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, ticked, tickless", [
    ({"online": "0-7\n", "nohz_full": "(null)\n", "isolated": "\n"}, list(range(8)), []),
    ({"online": "0-7\n", "nohz_full": "2-5\n", "isolated": "\n"}, [0, 1, 6, 7], [2, 3, 4, 5]),
    ({"online": "0-7\n", "nohz_full": "(null)\n", "isolated": "6-7\n"}, list(range(6)), [6, 7]),
    ({"online": "0-3,6-7\n", "nohz_full": "3,6\n", "isolated": "3\n"}, [0, 1, 2, 7], [3, 6]),
    ({"online": "0-1\n"}, [0, 1], []),  # a kernel built without either file
])  # fmt: skip
def test_ticked_and_tickless_cpus(tmp_path: Path, files: dict[str, str], ticked: list[int],
                                  tickless: list[int]) -> None:  # fmt: skip
    assert tick_cpus(sysfs(tmp_path, **files)) == (ticked, tickless)


def test_this_machines_cpus_all_tick_unless_kept_quiet() -> None:
    ticked, tickless = tick_cpus()
    assert sorted(ticked + tickless) == parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text())
