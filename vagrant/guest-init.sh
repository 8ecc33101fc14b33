#!/bin/sh
# Runs at boot in a `make vm-test` guest, from the checkout the image's init
# mounted at /src (read-only 9p), with /proc, /sys and /tmp mounted; /out is
# the harness's folder for this line (writable 9p). Each
# line the harness reads is tagged NODESAMPLER-<WHAT>= on the serial console.
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
# cgroup v2, as systemd mounts it, with the cpu controller on for the tree: the
# starved-engine tests cap an engine in a cgroup of their own (cpu.max).
mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null && echo +cpu >/sys/fs/cgroup/cgroup.subtree_control
# The harness's writable share: the kernel's text symbols, so that a hung
# guest's instruction pointers read as function names (vagrant/hung_guest.py).
mkdir -p /out && mount -t 9p -o trans=virtio,version=9p2000.L out /out \
    && grep -i ' [tw] ' /proc/kallsyms >/out/kallsyms
cd /src
python=/opt/nodesampler/venv/bin/python
# The checkout is read-only: without a cache elsewhere every Python process
# (pytest, each agent and child load a test starts) compiles every module it
# imports again, slowly under emulation.
export PYTHONPYCACHEPREFIX=/tmp/pycache
# The loopback interface, which nothing else here brings up (the pods test's
# kubelet listens on 127.0.0.1): SIOCGIFFLAGS, then SIOCSIFFLAGS with IFF_UP.
$python -c 'import fcntl, socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack_from("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))' || echo "NODESAMPLER-LOOPBACK=down"
echo "NODESAMPLER-KERNEL=$(uname -r) BCC=$(dpkg-query -W -f='${Version}' python3-bpfcc)"
# Kernel headers at the tier: none (the image installs none).
echo "NODESAMPLER-HEADERS=$([ -e "/lib/modules/$(uname -r)/build" ] && echo installed || echo none)"
echo "NODESAMPLER-UPTIME=booted $(cut -d' ' -f1 /proc/uptime)"
# `nodesampler.poke_loop=N`: the control, with no BPF program and no bcc (so
# before the backend is even tried):
# the same tracepoints and cpu-clock events turned on and off N times through
# tracefs and perf_event_open while every CPU switches tasks (text_poke_loop.py).
pokes=$(sed -n 's/.*nodesampler\.poke_loop=\([0-9][0-9]*\).*/\1/p' /proc/cmdline)
if [ -n "$pokes" ]; then
    parts=$(sed -n 's/.*nodesampler\.poke_parts=\([a-z,-]*\).*/\1/p' /proc/cmdline)
    $python vagrant/text_poke_loop.py "$pokes" ${parts:-tracepoints,cpu-clock} 2>&1
    echo "NODESAMPLER-EXIT=$?"
    echo 1 >/proc/sys/kernel/sysrq
    echo o >/proc/sysrq-trigger
    sleep 30
fi
# `nodesampler.load_loop=N` on the kernel command line (NODESAMPLER_VM_APPEND):
# instead of the tier, load and close the kernel backend N times, each load
# said on the console (the 6.1 stall's reproduction, vagrant/README.md).
loops=$(sed -n 's/.*nodesampler\.load_loop=\([0-9][0-9]*\).*/\1/p' /proc/cmdline)
if [ -n "$loops" ]; then
    $python -c 'import sys, time
from pathlib import Path
from sampler.kernel import sched
for i in range(int(sys.argv[1])):
    t = time.monotonic()
    sched.load(Path("/proc")).close()
    print(f"NODESAMPLER-LOAD={i + 1} {time.monotonic() - t:.1f} s", flush=True)' "$loops" 2>&1
    echo "NODESAMPLER-EXIT=$?"
    echo 1 >/proc/sys/kernel/sysrq
    echo o >/proc/sysrq-trigger
    sleep 30
fi
# A test that hangs fails after 5 minutes with every thread's stack, and the
# others still run; the slowest are printed (a whole run takes about 5 minutes
# under emulation).
tier=$(grep -lE '^pytestmark = \[?pytest\.mark\.kernel\b' tests/test_*.py)  # marked kernel, alone or first of a list
NODESAMPLER_REQUIRE_BPF=1 NODESAMPLER_ACCURACY_LOG=/tmp/accuracy.jsonl NODESAMPLER_BACKEND_REPORT=/tmp/backend \
    $python -m pytest -v -rfEs -p no:cacheprovider -o addopts= --timeout=300 --durations=15 -m kernel $tier 2>&1
tier=$?
echo "NODESAMPLER-UPTIME=tests $(cut -d' ' -f1 /proc/uptime)"
# Which backend the agent would load here (the tier's first load says, and
# how long it took), and if not the kernel's, why: no load of its own.
echo "NODESAMPLER-BACKEND=$(cat /tmp/backend 2>/dev/null || echo 'none: the tier loaded no backend')"
# The tier ran with no kernel headers installed. Now the kernel's own,
# unpacked from the packages the image keeps (the root is a snapshot: nothing
# persists), and the backend compiled against them.
# (tar is told to keep the root's links to directories: on a merged /usr,
# /lib is one, and replaced by a directory the guest could run nothing.)
for deb in /var/cache/nodesampler/headers/*.deb; do
    dpkg-deb --fsys-tarfile "$deb" | tar -x --keep-directory-symlink -C /
done
NODESAMPLER_REQUIRE_BPF=1 NODESAMPLER_REQUIRE_HEADERS=1 $python -m pytest -q -p no:cacheprovider -o addopts= \
    --timeout=300 tests/test_kernel_backend.py -k installed_headers 2>&1
headers=$?
echo "NODESAMPLER-HEADERS=$([ $headers = 0 ] && echo pass || echo FAIL)"  # compiled against them
[ $tier != 0 ] || tier=$headers
echo "NODESAMPLER-EXIT=$tier"
sed 's/^/NODESAMPLER-ACCURACY=/' /tmp/accuracy.jsonl 2>/dev/null
echo 1 >/proc/sys/kernel/sysrq
echo o >/proc/sysrq-trigger  # power off, rather than let init exit (a panic)
sleep 30
