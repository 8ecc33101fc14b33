import os
import subprocess
import sys
from pathlib import Path

import pytest

from sampler.sources import cgroup_view, procfs
from tests.fakeproc import pid_stat_line


@pytest.mark.parametrize(
    "comm",
    ["python3", "vllm serve", "a) (b", ") 1 2 3 (", "((x))", "name with  two  spaces", "x)", "", "ünï cödé"],
)
def test_pid_stat_parses_hostile_command_names(comm: str) -> None:
    st = procfs.parse_pid_stat(pid_stat_line(42, comm, ppid=7, pgrp=40, utime=11, stime=5, cutime=3, cstime=2,
                                             start=777, rss=321))
    assert (st.pid, st.comm, st.ppid, st.pgrp) == (42, comm, 7, 40)
    assert (st.self_ticks, st.child_ticks, st.start_ticks, st.rss_pages) == (16, 5, 777, 321)
    zombie = pid_stat_line(42, comm).replace(b") S ", b") Z ") if b") S " in pid_stat_line(42, comm) else None
    if zombie is not None:  # the state after the name, whatever the name holds
        assert procfs.parse_pid_stat(zombie).state == "Z" and st.state != "Z"


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"42 (python3",  # cut inside the name
        pid_stat_line(42)[:60],  # cut inside the fields
        b"42 (python3) S 1 x 42 0 -1 " + b"0 " * 30,  # a non-numeric field
        b"garbage",
    ],
)
def test_half_written_pid_stat_is_a_parse_error(data: bytes) -> None:
    with pytest.raises(procfs.ProcParseError):
        procfs.parse_pid_stat(data)


def test_cpu_times_count_iowait_as_idle_and_guest_once() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    t = procfs.parse_cpu_times(b"cpu  100 10 50 800 40 5 5 0 60 0\ncpu0 1 2 3\n")
    assert t.idle == 840
    assert t.busy == 100 + 10 + 50 + 5 + 5  # guest's 60 is inside user already
    assert t.total == 1010


@pytest.mark.parametrize("data", [b"", b"intr 1 2 3\n", b"cpu 1 2 x 4 5\n", b"cpu 1 2\n"])
def test_cpu_times_malformed(data: bytes) -> None:
    with pytest.raises(procfs.ProcParseError):
        procfs.parse_cpu_times(data)


def test_count_cpus() -> None:
    assert procfs.count_cpus(b"cpu  1 2 3 4\ncpu0 1\ncpu1 1\ncpu12 1\nintr 5\ncpufreq\n") == 3


def test_loadavg() -> None:
    assert procfs.parse_loadavg(b"0.50 1.25 3.00 2/300 4242\n") == (0.5, 1.25, 3.0)
    with pytest.raises(procfs.ProcParseError):
        procfs.parse_loadavg(b"0.50 1.2")


def test_meminfo_in_bytes() -> None:
    mem = procfs.parse_meminfo(b"MemTotal:  16 kB\nMemAvailable:   4 kB\nHugePages_Total:  3\nbroken line\n")
    assert mem == {"MemTotal": 16384, "MemAvailable": 4096, "HugePages_Total": 3}


def test_pressure_totals() -> None:
    data = b"some avg10=1.00 avg60=0.85 avg300=0.56 total=2582204\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=7\n"
    assert procfs.parse_pressure(data) == {"some": 2582204, "full": 7}
    with pytest.raises(procfs.ProcParseError):
        procfs.parse_pressure(b"nonsense\n")


MOUNTINFO = b"""\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 254:0 /srv /data\\040disk rw,relatime - ext4 /dev/vda rw
31 27 0:45 / /tmp rw - tmpfs tmpfs rw
32 27 8:16 / /mnt/models rw - xfs /dev/sdb rw
33 27 0:50 / /var/lib/docker/overlay2/x/merged rw - overlay overlay rw
"""

FILESYSTEMS = b"nodev\tsysfs\nnodev\ttmpfs\nnodev\tproc\n\text4\n\txfs\nnodev\toverlay\n"


def test_real_mounts_skip_pseudo_filesystems_and_repeat_devices() -> None:
    mounts = procfs.parse_mountinfo(MOUNTINFO)
    assert mounts[2].mount_point == "/data disk"  # octal escape undone
    real = procfs.real_mounts(mounts, procfs.parse_nodev_filesystems(FILESYSTEMS))
    assert [m.mount_point for m in real] == ["/", "/mnt/models"]


def test_malformed_mountinfo() -> None:
    with pytest.raises(procfs.ProcParseError):
        procfs.parse_mountinfo(b"22 27 0:21 / /proc rw,relatime\n")


def test_cmdline_and_cgroup() -> None:
    assert procfs.parse_cmdline(b"vllm\0serve\0--model\0x y\0") == "vllm serve --model x y"
    assert cgroup_view.host_paths(b"4:memory:/a/b\n0::/kubepods/pod1/c1\n") == ["/a/b", "/kubepods/pod1/c1"]


def test_vanished_process_is_process_gone(tmp_path: Path) -> None:
    with pytest.raises(procfs.ProcessGone):
        procfs.read_pid_stat(tmp_path, 12345)


def test_list_pids_of_missing_proc(tmp_path: Path) -> None:
    assert procfs.list_pids(tmp_path / "nope") == []


def test_whole_files_over_a_page_are_read_to_their_end(tmp_path: Path) -> None:
    """A seq_file hands out about a page per read: a short read is not the end.
    Real files: a private mount namespace crowded with 150 tmpfs mounts, and a
    process whose command line is 100 kB."""
    if os.geteuid() != 0:
        pytest.skip("a private mount namespace needs root")
    script = (
        "set -e; for i in $(seq 150); do mkdir -p $0/m$i; mount -t tmpfs -o size=4k t$i $0/m$i; done; "
        "cat /proc/self/mountinfo > $0/expected; "
        f"{sys.executable} -c 'import sys; from sampler.sources import procfs; "
        "sys.stdout.buffer.write(procfs.read_bytes(\"/proc/self/mountinfo\"))' > $0/got"
    )
    subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(tmp_path)], check=True,
                   cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    expected = (tmp_path / "expected").read_bytes()
    assert len(expected) > 16384 and expected.count(b"\n") > 150
    got = (tmp_path / "got").read_bytes()
    # The same table but for `cat`'s and python's own lines being the same: compare mount points.
    assert [line.split()[4] for line in got.splitlines()] == [line.split()[4] for line in expected.splitlines()]
    # Popen returns once the child began its exec (vfork), maybe before its
    # arguments are in place: its first line says they are.
    long = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()",
                             *(["x" * 1000] * 100)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert long.stdout is not None and long.stdout.readline() == b"ready\n"
        data = procfs.read_bytes(f"/proc/{long.pid}/cmdline")
        assert data == Path(f"/proc/{long.pid}/cmdline").read_bytes() and len(data) > 100_000
    finally:
        long.kill()
        long.wait()
