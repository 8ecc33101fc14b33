"""Where a hung `make vm-test` guest is stuck: each vCPU's instruction
pointer, from QEMU's monitor, named by the guest's own /proc/kallsyms (which
the guest copied out at boot), and whether its interrupts are off.

    python3 vagrant/hung_guest.py MONITOR_SOCKET KALLSYMS
"""

from __future__ import annotations

import bisect
import re
import socket
import sys
import time
from pathlib import Path

INTERRUPT_FLAG = 0x200


def _connect(path: str, timeout: float) -> socket.socket:
    # QEMU binds the socket (the file appears) a moment before it listens:
    # a connection refused in between is retried, within the timeout.
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(path)
            return s
        except ConnectionRefusedError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def monitor_command(path: str, command: str, timeout: float = 10.0) -> str:
    """One human-monitor command over QEMU's `-monitor unix:...` socket."""
    with _connect(path, timeout) as s:
        s.sendall(command.encode() + b"\n")
        out = b""
        try:
            while True:  # the monitor echoes, answers, then prompts; it never closes
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if out.count(b"(qemu)") >= 2:
                    break
        except TimeoutError:
            pass
    return out.decode(errors="replace")


def vcpus(registers: str) -> list[tuple[int, int]]:
    """(instruction pointer, flags) of each vCPU in `info registers -a`: RIP
    and RFL in long mode, EIP and EFL before it."""
    found = re.findall(r"[RE]IP=([0-9a-f]+) [RE]FL=([0-9a-f]+)", registers)
    return [(int(ip, 16), int(flags, 16)) for ip, flags in found]


class KernelSymbols:
    def __init__(self, kallsyms: str) -> None:
        pairs = []
        for line in kallsyms.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[1] in "tTwW":
                pairs.append((int(parts[0], 16), parts[2]))
        pairs.sort()
        self.addresses = [a for a, _ in pairs]
        self.names = [n for _, n in pairs]

    def name(self, address: int) -> str:
        i = bisect.bisect_right(self.addresses, address) - 1
        if i < 0 or self.addresses[i] == 0:
            return hex(address)
        return f"{self.names[i]}+{address - self.addresses[i]:#x}"


def describe(registers: str, symbols: KernelSymbols) -> list[str]:
    return [
        f"vCPU {n} at {symbols.name(rip)}, interrupts {'on' if rfl & INTERRUPT_FLAG else 'off'}"
        for n, (rip, rfl) in enumerate(vcpus(registers))
    ]


def code_bytes(answer: str) -> str:
    """The bytes of an `x/NXb ADDRESS` answer, as hex pairs."""
    return " ".join(
        b[2:]
        for line in answer.splitlines()
        if ":" in line
        for b in re.findall(r"0x[0-9a-f]{2}\b", line.split(":", 1)[1])
    )


def stuck_report(monitor: str, symbols: KernelSymbols, readings: int = 3, apart_s: float = 1.0) -> list[str]:
    """Each vCPU where it is, then whether it moved over `readings` readings
    `apart_s` apart, and the code memory holds at its last instruction
    pointer: a vCPU that stays on one instruction whose bytes say it would
    move on is executing something memory no longer holds."""
    first = monitor_command(monitor, "info registers -a")
    lines = describe(first, symbols)
    seen = [[ip] for ip, _ in vcpus(first)]
    for _ in range(readings - 1):
        time.sleep(apart_s)
        for n, (ip, _) in enumerate(vcpus(monitor_command(monitor, "info registers -a"))):
            if n < len(seen):
                seen[n].append(ip)
    for n, ips in enumerate(seen):
        where = "stayed at that instruction" if len(set(ips)) == 1 else f"moved ({len(set(ips))} places)"
        code = code_bytes(monitor_command(monitor, f"x/8xb {ips[-1]:#x}"))
        lines.append(f"vCPU {n} {where} over {len(ips)} readings {apart_s:g} s apart; memory there holds {code}")
    return lines


if __name__ == "__main__":
    monitor, kallsyms = sys.argv[1], Path(sys.argv[2])
    symbols = KernelSymbols(kallsyms.read_text() if kallsyms.exists() else "")
    for line in stuck_report(monitor, symbols):
        print(line)
