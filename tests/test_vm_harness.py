"""The parts of the VM harness (vagrant/) that run without booting a guest:
what a guest is built with, which tests it runs, and how its figures read.
Booting the guests is `make vm-test`'s job."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
VAGRANT = ROOT / "vagrant"


def vagrant_module(name: str) -> ModuleType:
    """A script of vagrant/ (not a package) as a module."""
    spec = importlib.util.spec_from_file_location(name, VAGRANT / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_image_package_list_brings_neither_a_kernel_nor_headers() -> None:
    """The kernel comes from the line's suite (--kernel-from), its headers are
    only downloaded: the guests' tier runs on a machine without any."""
    out = subprocess.run(["sh", VAGRANT / "provision.sh", "--packages"], capture_output=True, text=True, check=True)
    packages = out.stdout.strip().split(",")
    assert " " not in out.stdout.strip() and "" not in packages  # debootstrap's --include syntax
    assert {"python3-bpfcc", "python3-pytest"} <= set(packages)
    assert not [p for p in packages if p.startswith(("linux-image", "linux-headers"))]


def test_provision_refuses_an_unknown_argument() -> None:
    out = subprocess.run(["sh", VAGRANT / "provision.sh", "--bogus"], capture_output=True, text=True)
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr


def test_the_guest_runs_exactly_the_kernel_tier() -> None:
    """guest-init.sh picks the tier by the files' `pytestmark` line: a file
    marked otherwise would be silently left out of every guest."""
    init = (VAGRANT / "guest-init.sh").read_text()
    pattern = re.search(r"grep -lE '(.+?)' tests/test_\*\.py", init)  # an extended regex: Python's reads it alike
    assert pattern is not None
    tier = {p.name for p in (ROOT / "tests").glob("test_*.py") if re.search(pattern.group(1), p.read_text(), re.M)}
    marked = {p.name for p in (ROOT / "tests").glob("test_*.py") if "pytest.mark.kernel" in p.read_text()}
    assert "test_kernel_backend.py" in tier
    assert marked - {"test_vm_harness.py"} == tier


def test_scripts_parse() -> None:
    for script in ("run-tests.sh", "build-box.sh", "vagrant-up-test.sh"):
        subprocess.run(["bash", "-n", VAGRANT / script], check=True)
    for script in ("provision.sh", "guest-init.sh"):
        subprocess.run(["sh", "-n", VAGRANT / script], check=True)


def accuracy_rows(records: list[dict[str, object]]) -> list[str]:
    lines = "".join(json.dumps(r) + "\n" for r in records)
    out = subprocess.run([sys.executable, VAGRANT / "accuracy_table.py"], input=lines, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return [line.strip() for line in out.stdout.splitlines()]


def test_the_table_shows_each_comparisons_worst_error_against_its_bound() -> None:
    rows = accuracy_rows([
        {"check": "window mean, one-core", "measured": 0.99, "truth": 1.0, "error": 0.01, "bound": 0.03},
        {"check": "window mean, one-core", "measured": 0.96, "truth": 1.0, "error": 0.04, "bound": 0.03},
        {"check": "window mean, forker", "measured": 0.78, "truth": 0.77, "error": 0.013, "bound": 0.05},
    ])  # fmt: skip
    assert len(rows) == 2
    assert rows[0].startswith("window mean, one-core") and "4.00%" in rows[0] and "OUTSIDE 3%" in rows[0]
    assert rows[1].startswith("window mean, forker") and "1.30%" in rows[1] and "within 5%" in rows[1]


def test_a_kernel_test_records_its_comparison_before_asserting(tmp_path: Path) -> None:
    from tests.conftest import AccuracyLog

    log = AccuracyLog(tmp_path / "a.jsonl")
    log.record("c", 0.5, 0.0, 0.03)  # a truth of zero: an infinite error, never "within"
    log.record("c", 1.01, 1.0, 0.03)
    rows = accuracy_rows([json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()])
    [row] = rows
    assert row.startswith("c ") and "inf%" in row and "OUTSIDE 3%" in row


def test_a_hung_guest_reads_as_functions_and_interrupt_state() -> None:
    hung_guest = vagrant_module("hung_guest")
    kallsyms = (
        "ffffffff89c00000 T _text\n"
        "ffffffff89c47100 T native_queued_spin_lock_slowpath\n"
        "ffffffff89c47300 t __pv_queued_spin_unlock\n"
        "ffffffffc0a01000 t bpf_prog_6deef7357e7b4530_sched_switch\t[bpf]\n"
    )
    registers = (
        "CPU#0\nRAX=0000000000000000\nRIP=ffffffff89c4718c RFL=00000086 [--S--P-] CPL=0 II=0 A20=1 SMM=0 HLT=0\n"
        "CPU#1\nRIP=ffffffffc0a01010 RFL=00000246 [---Z-P-] CPL=0 II=0 A20=1 SMM=0 HLT=0\n"
        "CPU#2\nRIP=ffffffff80000000 RFL=00000002 [-------] CPL=0 II=0 A20=1 SMM=0 HLT=0\n"
    )
    assert hung_guest.describe(registers, hung_guest.KernelSymbols(kallsyms)) == [
        "vCPU 0 at native_queued_spin_lock_slowpath+0x8c, interrupts off",
        "vCPU 1 at bpf_prog_6deef7357e7b4530_sched_switch+0x10, interrupts on",
        "vCPU 2 at 0xffffffff80000000, interrupts off",
    ]
    # A guest that could not copy its symbols out still gets addresses.
    without = hung_guest.describe(registers, hung_guest.KernelSymbols(""))
    assert without[0] == "vCPU 0 at 0xffffffff89c4718c, interrupts off"


def test_code_bytes_read_from_a_monitor_answer() -> None:
    hung_guest = vagrant_module("hung_guest")
    answer = "x/8xb 0xffffffff81e0a1bc\r\nffffffff81e0a1bc: 0xcc 0x1f 0x44 0x00 0x00 0x49 0x8b 0x44\r\n(qemu) "
    assert hung_guest.code_bytes(answer) == "cc 1f 44 00 00 49 8b 44"


def test_the_hang_report_reads_a_real_qemu_monitor(tmp_path: Path) -> None:
    """A paused QEMU (no guest at all) answers `info registers -a` over the
    same kind of socket the harness gives its guests."""
    hung_guest = vagrant_module("hung_guest")
    sock = tmp_path / "monitor.sock"
    qemu = subprocess.Popen(["qemu-system-x86_64", "-accel", "tcg", "-smp", "2", "-S", "-nodefaults", "-display",
                             "none", "-monitor", f"unix:{sock},server=on,wait=on"], stderr=subprocess.PIPE)  # fmt: skip
    try:
        # QEMU binds the socket, then waits for its first client: a file with
        # no event to await but its appearing (bounded; QEMU exiting ends it).
        deadline = time.monotonic() + 30
        while not sock.exists() and qemu.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        registers = hung_guest.monitor_command(str(sock), "info registers -a")
        rows = hung_guest.describe(registers, hung_guest.KernelSymbols(""))
        # Two vCPUs at the reset vector, in real mode (EIP/EFL), interrupts off.
        assert rows == ["vCPU 0 at 0xfff0, interrupts off", "vCPU 1 at 0xfff0, interrupts off"], registers
        # Paused, neither moves; what memory holds there is read back, eight bytes.
        report = hung_guest.stuck_report(str(sock), hung_guest.KernelSymbols(""), readings=2, apart_s=0.1)
        assert report[:2] == rows
        for n, line in enumerate(report[2:]):
            head, _, code = line.partition("; memory there holds ")
            assert head == f"vCPU {n} stayed at that instruction over 2 readings 0.1 s apart", line
            assert re.fullmatch(r"([0-9a-f]{2} ){7}[0-9a-f]{2}", code), line
    finally:
        qemu.kill()
        qemu.wait()
