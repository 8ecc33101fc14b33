#!/usr/bin/env bash
# `make vm-test`: the kernel test tier on real guest kernels, without Vagrant.
#
# For each kernel line (Debian 12: 6.1, Debian 13: 6.12): a Debian root made
# with debootstrap (its kernel, that kernel's own headers, bcc and the test
# tools from Debian), packed into an ext4 image with `mkfs.ext4 -d` (no loop
# devices), cached by a hash of the package list and this script; then its
# kernel and initrd are booted directly by QEMU under TCG (no hardware
# virtualisation here), with the checkout shared over 9p. A small init
# mounts what the tests need, runs tests/test_kernel_backend.py, prints its
# exit code on the serial console and powers off.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
cache=${NODESAMPLER_VM_CACHE:-$root/.vm-cache}
mirror=${NODESAMPLER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
lines=${NODESAMPLER_VM_LINES:-"bookworm trixie"}
packages="linux-image-amd64,linux-headers-amd64,python3-bpfcc,python3-numpy,python3-pytest,util-linux,procps,kmod"
mkdir -p "$cache"

# What this harness needs on the host, installed by itself (it is not part of `make setup`).
missing=""
for tool in debootstrap:debootstrap qemu-system-x86_64:qemu-system-x86 mkfs.ext4:e2fsprogs; do
    command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool##*:}"
done
if [ -n "$missing" ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

image() {  # suite -> directory with rootfs.ext4, vmlinuz, initrd.img
    local suite=$1 key dir
    key=$( (echo "$suite $packages"; cat "$0") | sha256sum | cut -c1-12)
    dir="$cache/$suite-$key"
    if [ -s "$dir/rootfs.ext4" ]; then echo "$dir"; return; fi
    rm -rf "$dir" && mkdir -p "$dir"
    local t0=$SECONDS
    debootstrap --variant=minbase --include="$packages" "$suite" "$dir/root" "$mirror" >"$dir/debootstrap.log" 2>&1 \
        || { tail -20 "$dir/debootstrap.log" >&2; return 1; }
    cp "$dir"/root/boot/vmlinuz-* "$dir/vmlinuz"
    cp "$dir"/root/boot/initrd.img-* "$dir/initrd.img"
    local kver; kver=$(ls "$dir/root/lib/modules")
    cat >"$dir/root/init-tests" <<INIT
#!/bin/sh
mount -t proc proc /proc; mount -t sysfs sys /sys
mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null
mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
mount -t tmpfs tmpfs /tmp
mkdir -p /src && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 src /src
cd /src
echo "NODESAMPLER-KERNEL=\$(uname -r) BCC=\$(dpkg-query -W python3-bpfcc | cut -f2)"
NODESAMPLER_REQUIRE_BPF=1 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_kernel_backend.py 2>&1
echo "NODESAMPLER-EXIT=\$?"
echo 1 > /proc/sys/kernel/sysrq
echo o > /proc/sysrq-trigger  # power off, rather than let init exit (a panic)
sleep 30
INIT
    chmod +x "$dir/root/init-tests"
    echo "$kver" >"$dir/kernel-version"
    mkfs.ext4 -q -F -L root -d "$dir/root" "$dir/rootfs.ext4" 6G >/dev/null
    rm -rf "$dir/root"
    echo "image $suite ($kver) built in $((SECONDS - t0)) s" >&2
    echo "$dir"
}

boot() {  # image dir -> serial log; exit code of the tests
    local dir=$1 log=$2
    timeout 1800 qemu-system-x86_64 -accel tcg -cpu qemu64 -smp 2 -m 3072 -nographic -no-reboot \
        -kernel "$dir/vmlinuz" -initrd "$dir/initrd.img" \
        -append "root=/dev/vda rw console=ttyS0 init=/init-tests panic=-1" \
        -drive "file=$dir/rootfs.ext4,format=raw,if=virtio,snapshot=on" \
        -virtfs "local,path=$root,mount_tag=src,security_model=none,readonly=on" >"$log" 2>&1 || true
    grep -a -o 'NODESAMPLER-EXIT=[0-9]*' "$log" | tail -n 1 | cut -d= -f2 || true
}

failed=0
printf '%-10s %-22s %-18s %-8s %s\n' line kernel bcc result seconds
for suite in $lines; do
    t0=$SECONDS
    dir=$(image "$suite") || { printf '%-10s %-22s %-18s %-8s\n' "$suite" - - "no image"; failed=1; continue; }
    log="$cache/$suite.serial.log"
    rc=$(boot "$dir" "$log")
    kernel=$(grep -a -o 'NODESAMPLER-KERNEL=[^ ]*' "$log" | cut -d= -f2 || true)
    bcc=$(grep -a -o 'BCC=[^ ]*' "$log" | cut -d= -f2 | tr -d '\r' || true)
    result=$([ "${rc:-x}" = 0 ] && echo pass || echo FAIL)
    [ "$result" = pass ] || failed=1
    printf '%-10s %-22s %-18s %-8s %s\n' "$suite" "${kernel:--}" "${bcc:--}" "$result" "$((SECONDS - t0))"
    grep -a -E 'passed|failed|error' "$log" | tail -n 3 | sed 's/^/    /'
done
exit $failed
