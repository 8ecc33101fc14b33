from pathlib import Path

import pytest

from sampler.sources.machine import MachineCpuSampler, MachineGaugeReader, PressureReader
from tests.fakeproc import FakeProc


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def test_first_sample_reports_nothing_then_utilisation(proc: FakeProc) -> None:
    s = MachineCpuSampler(proc.root)
    proc.set_cpu(user=1000, idle=1000)
    assert s.sample() is None
    proc.set_cpu(user=1030, idle=1070, system=10, iowait=40, guest=20)  # guest is inside user
    # busy 40, idle 70 + iowait 40: 40 / 150
    assert s.sample() == pytest.approx(100 * 40 / 150)


def test_counter_going_backwards_reports_nothing_for_that_sample(proc: FakeProc) -> None:
    s = MachineCpuSampler(proc.root)
    proc.set_cpu(user=1000, idle=1000)
    s.sample()
    proc.set_cpu(user=900, idle=1200)  # a CPU went away: its ticks left the sum
    assert s.sample() is None
    proc.set_cpu(user=950, idle=1250)
    assert s.sample() == pytest.approx(50.0)


def test_steal_is_apart_and_not_busy(proc: FakeProc) -> None:
    s = MachineCpuSampler(proc.root)
    proc.set_cpu(user=1000, idle=1000, steal=100)
    s.sample()
    proc.set_cpu(user=1030, idle=1040, steal=130)  # busy 30, idle 40, stolen 30 of 100
    assert s.sample() == pytest.approx(30.0) and s.steal == pytest.approx(30.0)
    proc.set_cpu(user=1060, idle=1080, steal=120)  # steal backwards: that figure alone is lost
    assert s.sample() == pytest.approx(100 * 30 / 70) and s.steal is None


def test_iowait_going_backwards_costs_no_sample(proc: FakeProc) -> None:
    s = MachineCpuSampler(proc.root)
    proc.set_cpu(user=1000, idle=1000, iowait=50)
    s.sample()
    proc.set_cpu(user=1050, idle=1060, iowait=40)  # iowait -10 moved into idle: idle+iowait +50
    assert s.sample() == pytest.approx(50.0)


def test_no_tick_elapsed_is_not_an_idle_machine(proc: FakeProc) -> None:
    s = MachineCpuSampler(proc.root)
    s.sample()
    assert s.sample() is None


def test_missing_or_half_written_proc_reports_nothing(tmp_path: Path, proc: FakeProc) -> None:
    assert MachineCpuSampler(tmp_path / "no-proc").sample() is None
    assert MachineGaugeReader(tmp_path / "no-proc").read() == {}
    s = MachineCpuSampler(proc.root)
    proc.set_cpu(user=1, idle=1)
    s.sample()
    (proc.root / "stat").write_bytes(b"cpu  1 2")
    assert s.sample() is None
    # After a bad reading there is nothing to compare with again.
    proc.set_cpu(user=10, idle=10)
    assert s.sample() is None
    proc.set_cpu(user=20, idle=20)
    assert s.sample() == pytest.approx(50.0)


def test_gauges(proc: FakeProc, tmp_path: Path) -> None:
    (proc.root / "self").mkdir()
    disk = tmp_path / "disk"
    disk.mkdir()
    (proc.root / "self" / "mountinfo").write_text(
        f"27 1 254:0 / {disk} rw - ext4 /dev/vda rw\n31 27 0:45 / /tmp rw - tmpfs tmpfs rw\n"
        "40 27 254:7 / /gone rw - ext4 /dev/vdb rw\n"  # unreachable mount point: left out
    )
    (proc.root / "filesystems").write_text("nodev\ttmpfs\n\text4\n")
    g = MachineGaugeReader(proc.root).read()
    assert g["cpus"] == 2
    assert g["load"] == {"1m": 0.5, "5m": 0.4, "15m": 0.3}
    assert g["memory_bytes"] == 16000000 * 1024
    assert g["memory_available_bytes"] == 4000000 * 1024
    assert g["memory_used_bytes"] == 12000000 * 1024
    [d] = g["disks"]
    assert d["mount"] == str(disk) and d["bytes"] > 0 and 0 <= d["used_bytes"] <= d["bytes"]


def test_memory_without_memavailable_has_no_used(proc: FakeProc) -> None:
    (proc.root / "meminfo").write_text("MemTotal:  100 kB\nMemFree:  50 kB\n")  # a kernel before 3.14
    (proc.root / "loadavg").write_text("garbage")
    g = MachineGaugeReader(proc.root).read()
    assert g["memory_bytes"] == 102400
    assert "memory_used_bytes" not in g and "memory_available_bytes" not in g
    assert "load" not in g and "disks" not in g


def test_pressure_share_of_window() -> None:
    start = {"cpu": {"some": 1_000_000, "full": 0}, "io": {"some": 0, "full": 0}}
    end = {"cpu": {"some": 1_500_000, "full": 0}, "io": {"some": 5_000_000, "full": 1_000_000}}
    assert PressureReader.share(start, end, 5.0) == {"cpu": {"some": 0.1, "full": 0.0},
                                                     "io": {"some": 1.0, "full": 0.2}}  # fmt: skip
    assert PressureReader.share(None, end, 5.0) is None
    assert PressureReader.share({"cpu": {"some": 5}}, {"cpu": {"some": 1}}, 5.0) is None  # backwards: not measured


def test_pressure_of_each_resource_the_kernel_has(proc: FakeProc) -> None:
    (proc.root / "pressure").mkdir()
    (proc.root / "pressure" / "cpu").write_text(
        "some avg10=1.00 avg60=0.85 avg300=0.56 total=2582204\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    (proc.root / "pressure" / "memory").write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=17\n")  # 4.20: no full
    (proc.root / "pressure" / "io").write_text("garbage\n")
    assert PressureReader(proc.root).read() == {"cpu": {"some": 2582204, "full": 0}, "memory": {"some": 17}}


def test_pressure_absent_without_psi(tmp_path: Path) -> None:
    assert PressureReader(tmp_path).read() is None


def test_a_disk_mounted_after_150_tmpfs_mounts_is_reported(tmp_path: Path) -> None:
    """A Kubernetes node has hundreds of mounts (every pod's volumes): in a
    private mount namespace, 150 tmpfs mounts and then a real ext4 disk (a
    loop device); the sampler, run inside, reports the disk at its size."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None or not Path("/dev/loop-control").exists():
        pytest.skip("needs root, mkfs.ext4 and loop devices")
    image = tmp_path / "disk.img"
    with image.open("wb") as f:
        f.truncate(64 * 2**20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    # The sampler's own mount table (a proc root without pid 1: the namespace's, not the host's).
    view = tmp_path / "proc"
    view.mkdir()
    (view / "self").symlink_to("/proc/self")
    (view / "filesystems").symlink_to("/proc/filesystems")
    probe = ("import json, os, sys; from pathlib import Path; from sampler.sources.machine import MachineGaugeReader; "
             f"d = {{x['mount']: x for x in MachineGaugeReader(Path('{view}')).read_disks()}}; "
             "st = os.statvfs(sys.argv[1]); "
             "print(json.dumps([d.get(sys.argv[1]), st.f_blocks * st.f_frsize]))")  # fmt: skip
    script = (
        "set -e; for i in $(seq 150); do mkdir -p $0/m$i; mount -t tmpfs -o size=4k t$i $0/m$i; done; "
        "mkdir -p $0/disk; mount -o loop $1 $0/disk; "
        f"{sys.executable} -c \"{probe}\" $0/disk"
    )
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(tmp_path), str(image)],
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert r.returncode == 0, r.stderr
    disk, size = json.loads(r.stdout)
    assert disk is not None, "the disk after 150 mounts is missing"
    assert disk["bytes"] == size and 50 * 2**20 < size < 64 * 2**20
