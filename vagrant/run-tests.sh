#!/usr/bin/env bash
# `make vm-test`: the kernel test tier on real guest kernels, without Vagrant.
#
# For each kernel line (Debian 11: 5.10, 12: 6.1, 13: 6.12, and unstable: the
# newest kernel Debian publishes; a line named SUITE-arm64 is that suite's
# arm64 kernel and userland, emulated): a Debian root made with debootstrap from
# vagrant/provision.sh's package list (its kernel, bcc and the test tools from
# Debian; no kernel headers installed, their packages kept aside), provision.sh run
# in it through chroot, packed into an ext4 image with `mkfs.ext4 -d` (no loop
# devices) and cached by a hash of the package list, provision.sh and the
# image's init (the images a run lacks are built side by side before the first
# guest boots). Then its kernel and initrd are booted directly by QEMU under
# TCG (no hardware virtualisation here; an arm64 line under
# qemu-system-aarch64's `virt` machine, its root built through qemu-user and
# binfmt_misc, which the harness registers where it is not). The init only mounts the checkout
# (read-only 9p) and runs vagrant/guest-init.sh from it, which runs the
# kernel test tier (the files marked `pytestmark = pytest.mark.kernel`) with
# no kernel headers (its first load says which backend the agent would load
# there, and how long the load took), then unpacks the
# kernel's headers and compiles the backend against them, prints the exit code
# and each accuracy comparison on the serial console, and powers off. A guest
# that hangs is
# named (vagrant/hung_guest.py) and booted again; so is one whose kernel died
# (an Oops or a panic) before the tests ended.
#
# NODESAMPLER_VM_LINES (default "bullseye bookworm trixie-arm64 sid": one line a
# kernel version and one an architecture, Debian 13's 6.12 on arm64; `trixie`
# is its amd64 line), NODESAMPLER_VM_CACHE
# (default .vm-cache), NODESAMPLER_DEBIAN_MIRROR, NODESAMPLER_VM_HANG_SECONDS
# (360), NODESAMPLER_VM_HANG_RETRIES (2), NODESAMPLER_VM_APPEND (more of the
# guest kernel's command line; `nodesampler.load_loop=N` loads the backend N
# times instead of the tier, `nodesampler.poke_loop=N` runs the no-BPF control
# of vagrant/text_poke_loop.py), NODESAMPLER_VM_ACCEL (QEMU's -accel, default
# tcg; tcg,thread=single for one host thread for all vCPUs),
# NODESAMPLER_VM_CPU (-cpu, default qemu64), NODESAMPLER_VM_BOOT_SECONDS (a
# boot's limit, 1200), NODESAMPLER_VM_PARALLEL (guests booted side by side, 1:
# two take 85% of the time here, and load each guest past what its tests allow, below).
#
# `run-tests.sh --images` builds the images the lines lack and boots nothing:
# a machine's cache made ready ahead of its first run (the arm64 image takes
# 10-26 minutes under qemu-user). Not beside `make test`: both apt and
# binfmt_misc registration race there, and the builds' CPU starves its tests.
set -euo pipefail
images_only=0
case ${1:-} in
    --images) images_only=1 ;;
    "") ;;
    *) echo "run-tests.sh: unknown argument $1 (--images: build the images only)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
root=$(pwd)
cache=${NODESAMPLER_VM_CACHE:-$root/.vm-cache}
mirror=${NODESAMPLER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
lines=${NODESAMPLER_VM_LINES:-"bullseye bookworm trixie-arm64 sid"}
hang_after=${NODESAMPLER_VM_HANG_SECONDS:-360}
hang_retries=${NODESAMPLER_VM_HANG_RETRIES:-2}
append=${NODESAMPLER_VM_APPEND:-}
accel=${NODESAMPLER_VM_ACCEL:-tcg}
cpu_model=${NODESAMPLER_VM_CPU:-qemu64}
boot_limit=${NODESAMPLER_VM_BOOT_SECONDS:-1200}
parallel=${NODESAMPLER_VM_PARALLEL:-1}
started=$SECONDS
mkdir -p "$cache"

# A line: a Debian suite, amd64; SUITE-arm64: the suite's arm64 kernel and userland.
suite_of() { echo "${1%-arm64}"; }
arch_of() { case $1 in *-arm64) echo arm64 ;; *) echo amd64 ;; esac; }

# What this harness needs on the host, installed by itself (debootstrap is not part of `make setup`).
tools="debootstrap:debootstrap qemu-system-x86_64:qemu-system-x86 mkfs.ext4:e2fsprogs"
case " $lines " in
    *-arm64\ *) tools="$tools qemu-system-aarch64:qemu-system-arm qemu-aarch64-static:qemu-user-static" ;;
esac
missing=""
for tool in $tools; do
    command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool##*:}"
done
if [ -n "$missing" ]; then
    # apt waits for another apt rather than fail (a build of the agent's image, `make setup`).
    apt-get -o DPkg::Lock::Timeout=900 update -q \
        && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=900 install -y -q --no-install-recommends $missing
fi

# An arm64 root is built by running its programs (dpkg's scripts, provision.sh)
# under qemu-user: binfmt_misc hands them to qemu-aarch64-static, registered
# with Debian's own entry (its F flag opens the interpreter now, so it runs
# inside the chroot too) where nothing registered it.
arm64_binfmt() {
    local misc=/proc/sys/fs/binfmt_misc
    [ -e "$misc/register" ] || mount -t binfmt_misc binfmt_misc "$misc"
    [ -e "$misc/qemu-aarch64" ] || cat /usr/lib/binfmt.d/qemu-aarch64.conf >"$misc/register"
    [ "$(head -n 1 "$misc/qemu-aarch64")" = enabled ] || echo 1 >"$misc/qemu-aarch64"
}

packages=$(sh vagrant/provision.sh --packages)
# What the guests need that Debian does not package: google-re2 (the agent's
# selector regexes) and msgspec (the wire's schema), at the image's pins, as
# wheels for every Python the guests' userlands have, downloaded here (the
# guest has no network, and its minimal root no CA bundle): each image's build
# installs the ones its Python takes.
wheels_pin=$(grep -E '^(google-re2|msgspec)==' deploy/image-requirements.txt | tr '\n' ' ')
wheels_of() {  # arch -> the folder of its wheels, downloaded once
    local arch=$1 machine
    case $arch in arm64) machine=aarch64 ;; *) machine=x86_64 ;; esac
    local dir="$cache/wheels-$arch-$(echo "$wheels_pin" | sha256sum | cut -c1-12)"
    if [ ! -e "$dir/.complete" ]; then
        rm -rf "$dir" && mkdir -p "$dir"
        for py in 3.11 3.12 3.13 3.14; do
            "$root/.venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
                --python-version "$py" --platform "manylinux_2_28_$machine" --platform "manylinux_2_17_$machine" \
                -d "$dir" $wheels_pin || echo "vm-test: no $wheels_pin $arch wheel for Python $py" >&2
        done
        touch "$dir/.complete"
    fi
    echo "$dir"
}
# The image's whole init: everything else comes from the checkout at boot.
init='#!/bin/sh
mount -t proc proc /proc 2>/dev/null; mount -t sysfs sys /sys 2>/dev/null; mount -t tmpfs tmpfs /tmp
modprobe -q 9pnet_virtio 2>/dev/null  # 5.10 does not load the transport by itself
mkdir -p /src && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 src /src
exec sh /src/vagrant/guest-init.sh'

# The Debian suite whose userland a line's guest runs: its own, but for
# Debian 11, whose Python (3.9) cannot run the agent (3.11 or newer). There the
# agent runs from its image (Debian 12's userland and bcc) on the node's 5.10
# kernel, and so does the guest: Debian 12's root with Debian 11's kernel.
userland_of() { case $1 in bullseye) echo bookworm ;; *) suite_of "$1" ;; esac; }

image_dir() {  # line -> where its image is cached
    echo "$cache/$1-$( (echo "$1 $(userland_of "$1") $packages $wheels_pin"; echo "$init"; cat vagrant/provision.sh) \
        | sha256sum | cut -c1-12)"
}

build_image() {  # line dir: rootfs.ext4, vmlinuz, initrd.img and build-seconds in dir
    local line=$1 dir=$2 arch old
    arch=$(arch_of "$line")
    # The line's images built from other inputs go: a cache outside the
    # checkout (CI's) would otherwise keep one of each for good.
    for old in "$cache/$line"-*; do
        if [[ $old =~ /$line-[0-9a-f]{12}$ ]]; then rm -rf "$old"; fi
    done
    rm -rf "$dir" && mkdir -p "$dir"
    local t0=$SECONDS
    [ "$arch" = amd64 ] || arm64_binfmt
    debootstrap --arch "$arch" --variant=minbase --include="$packages" "$(userland_of "$line")" "$dir/root" "$mirror" \
        >"$dir/debootstrap.log" 2>&1 || { tail -20 "$dir/debootstrap.log" >&2; return 1; }
    cp vagrant/provision.sh "$dir/root/provision.sh"
    mkdir -p "$dir/root/tmp/wheels" && cp "$(wheels_of "$arch")"/*.whl "$dir/root/tmp/wheels/"
    chroot "$dir/root" env NODESAMPLER_WHEELS=/tmp/wheels sh /provision.sh --kernel-from "$(suite_of "$line")" --no-project \
        >>"$dir/debootstrap.log" 2>&1 || { tail -20 "$dir/debootstrap.log" >&2; return 1; }
    rm -rf "$dir/root/provision.sh" "$dir/root/tmp/wheels"
    cp "$dir"/root/boot/vmlinuz-* "$dir/vmlinuz"
    cp "$dir"/root/boot/initrd.img-* "$dir/initrd.img"
    echo "$init" >"$dir/root/init-tests"
    chmod +x "$dir/root/init-tests"
    mkfs.ext4 -q -F -L root -d "$dir/root" "$dir/rootfs.ext4" 6G >/dev/null
    rm -rf "$dir/root"
    echo "$((SECONDS - t0))" >"$dir/build-seconds"
}

boot() {  # line, image dir, out dir -> the tests' exit code, or "hung"; the serial log in out dir
    local line=$1 dir=$2 out=$3
    local log=$out/serial.log
    rm -rf "$out" && mkdir -p "$out"
    # An arm64 guest: QEMU's `virt` board, a CPU with every feature QEMU
    # emulates (LSE atomics among them, as Grace and Graviton have), pointer
    # authentication by QEMU's own cheap algorithm (the architected one is
    # most of an emulated arm64 CPU's time), one host thread per vCPU.
    local machine=(qemu-system-x86_64 -accel "$accel" -cpu "$cpu_model") console=ttyS0
    if [ "$(arch_of "$line")" = arm64 ]; then
        machine=(qemu-system-aarch64 -M virt -accel tcg,thread=multi -cpu max,pauth-impdef=on)
        console=ttyAMA0
    fi
    "${machine[@]}" -smp 2 -m 3072 -nographic -no-reboot \
        -kernel "$dir/vmlinuz" -initrd "$dir/initrd.img" \
        -append "root=/dev/vda rw console=$console init=/init-tests panic=-1 $append" \
        -drive "file=$dir/rootfs.ext4,format=raw,if=virtio,snapshot=on" \
        -virtfs "local,path=$root,mount_tag=src,security_model=none,readonly=on" \
        -virtfs "local,path=$out,mount_tag=out,security_model=none" \
        -monitor "unix:$out/monitor.sock,server=on,wait=off" >"$log" 2>&1 </dev/null &
    local qemu=$! size=-1 quiet=0 started=$SECONDS
    # Hung: the kernel reports a lockup or an RCU stall; or the console has
    # said nothing for $hang_after seconds (a test stuck in userspace would
    # have been failed by pytest-timeout after 5 minutes); or the boot has
    # run $boot_limit seconds (a whole line takes about 8 minutes).
    while kill -0 "$qemu" 2>/dev/null; do
        sleep 10
        if [ "$(stat -c %s "$log")" = "$size" ]; then quiet=$((quiet + 10)); else size=$(stat -c %s "$log"); quiet=0; fi
        if [ "$quiet" -ge "$hang_after" ] || [ $((SECONDS - started)) -ge "$boot_limit" ] \
            || grep -a -q -E 'BUG: soft lockup|detected stalls on CPUs|blocked for more than' "$log"; then
            python3 vagrant/hung_guest.py "$out/monitor.sock" "$out/kallsyms" >"$out/hung.txt" 2>&1 || true
            grep -a -m 1 -E 'BUG: soft lockup|detected stalls on CPUs|blocked for more than' "$log" \
                | sed 's/^\[[ 0-9.]*\] //' >>"$out/hung.txt" || true
            kill "$qemu"; wait "$qemu" 2>/dev/null || true
            echo hung; return
        fi
    done
    wait "$qemu" 2>/dev/null || true
    # A kernel that died before the tests said how they ended (an Oops, a panic:
    # under TCG, an int3 left by the kernel's live patching of tracepoints,
    # vagrant/README.md) is a boot to try again, named like a hang.
    if ! grep -a -q 'NODESAMPLER-EXIT=' "$log" && grep -a -q -E 'Kernel panic|Oops:' "$log"; then
        { grep -a -m 1 -E 'Oops:|Kernel panic' "$log"; grep -a -m 1 'RIP:' "$log"; } | tr -d '\r' \
            | sed 's/^\[[ 0-9.]*\] //' | paste -s -d ' ' >"$out/hung.txt" || true
        echo hung; return
    fi
    grep -a -o 'NODESAMPLER-EXIT=[0-9]*' "$log" | tail -n 1 | cut -d= -f2 || true
}

tagged() { grep -a -o "NODESAMPLER-$1=.*" "$2" | cut -d= -f2- | tr -d '\r' || true; }

# Every image not cached yet is built first, all side by side (debootstrap
# mostly waits on the mirror), so that no build runs beside a guest's tests.
declare -A building=()
for suite in $lines; do
    dir=$(image_dir "$suite")
    [ -s "$dir/rootfs.ext4" ] || { build_image "$suite" "$dir" >"$cache/$suite.build.log" 2>&1 & building[$suite]=$!; }
done
for suite in "${!building[@]}"; do
    wait "${building[$suite]}" || building[$suite]=failed
done
if [ "$images_only" = 1 ]; then
    for suite in $lines; do
        case ${building[$suite]:-cached} in
            failed) echo "vm-test: $suite: no image"; sed 's/^/    /' "$cache/$suite.build.log" ;;
            cached) echo "vm-test: $suite: image cached" ;;
            *) echo "vm-test: $suite: image built in $(cat "$(image_dir "$suite")/build-seconds") s" ;;
        esac
    done
    echo "vm-test: images in $((SECONDS - started)) s"
    for suite in "${!building[@]}"; do [ "${building[$suite]}" != failed ] || exit 1; done
    exit 0
fi

# One line's guest, booted again where it hung or died: its exit code (or
# "hung"), the hangs' reasons and its seconds, in $cache/<line>.result.
run_line() {
    local suite=$1 t0=$SECONDS dir out rc hung="" retry
    dir=$(image_dir "$suite")
    out="$cache/$suite.out"
    rc=$(boot "$suite" "$dir" "$out")
    for retry in $(seq "$hang_retries"); do
        [ "$rc" = hung ] || break
        # Each hang reported on its own line; each hung boot's output kept.
        hung="$hung$(paste -s -d ';' "$out/hung.txt")|"
        rm -rf "$out.hung$retry" && mv "$out" "$out.hung$retry"
        rc=$(boot "$suite" "$dir" "$out")
    done
    printf '%s\n%s\n%s\n' "$rc" "$hung" "$((SECONDS - t0))" >"$cache/$suite.result"
}

# The guests, $parallel at a time, the longest first (an emulated arm64 line,
# then the newest kernels, which run the most tests): a guest keeps about
# 1.1 of the host's cores busy (TCG, 2 vCPUs; measured on a 2-core machine:
# 460 s of CPU in a 400 s line), yet two side by side ran each 1.6 times
# slower and finished the four lines in 1,492 s against 1,753 one at a time. Each guest's clock is the host's: a test
# in a guest held off the host's CPUs sees a loaded machine, which every
# test allows for.
ordered=$(for suite in $lines; do case $suite in *-arm64) echo "$suite" ;; esac; done
          for suite in $lines; do case $suite in *-arm64) ;; *) echo "$suite" ;; esac; done | tac)
for suite in $ordered; do
    rm -f "$cache/$suite.result"
    [ "${building[$suite]:-}" != failed ] || continue
    while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
    run_line "$suite" &
done
wait

failed=0
failed_lines=""
printf '%-13s %-22s %-16s %-9s %-10s %-6s %s\n' line kernel bcc backend headers result \
    "seconds: image (built side by side), boot, tests, all"
for suite in $lines; do
    dir=$(image_dir "$suite")
    built=cached
    if [ "${building[$suite]:-}" = failed ]; then
        printf '%-13s %s\n' "$suite" "FAIL: no image"; sed 's/^/    /' "$cache/$suite.build.log"; failed=1
        failed_lines="$failed_lines $suite"; continue
    elif [ -n "${building[$suite]:-}" ]; then
        built=$(cat "$dir/build-seconds")
    fi
    out="$cache/$suite.out"
    log="$out/serial.log"
    { read -r rc; read -r hung; read -r seconds; } <"$cache/$suite.result" || rc=""
    kernel=$(tagged KERNEL "$log" | cut -d' ' -f1)
    bcc=$(tagged KERNEL "$log" | sed -n 's/.*BCC=//p')
    backend=$(tagged BACKEND "$log")
    headers=$(tagged HEADERS "$log" | paste -s -d /)  # at the tier / compiled against once unpacked
    case ${rc:-x} in 0) result=pass ;; hung) result=HUNG ;; *) result=FAIL ;; esac
    [ "$result" = pass ] || { failed=1; failed_lines="$failed_lines $suite"; }
    stages=$(tagged UPTIME "$log" | awk '{ printf "%.0f ", $2 - prev; prev = $2 }')
    # "bpf (14 s to load)" -> bpf/14s; "proc: why" -> proc
    loaded=$(echo "$backend" | sed -n 's/^bpf (\([0-9]*\) s to load)$/\/\1s/p')
    printf '%-13s %-22s %-16s %-9s %-10s %-6s %s\n' "$suite" "${kernel:--}" "${bcc:--}" "${backend%%[: ]*}$loaded" \
        "${headers:--}" "$result" \
        "$built, ${stages:-- - }${seconds:--}"
    [ "${backend%%[: ]*}" = bpf ] || echo "    backend: ${backend:-none reported}"
    [ -z "${hung:-}" ] || echo "${hung%|}" | tr '|' '\n' | sed "s|^|    a boot hung or died, booted again: |"
    [ "$result" != HUNG ] || sed 's/^/    hung: /' "$out/hung.txt"
    tagged ACCURACY "$log" | python3 vagrant/accuracy_table.py || echo "    (accuracy figures unreadable)"
    sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -a -E '^(FAILED|ERROR) |(passed|failed|error).* in [0-9.]+s' | sed "s/^/    /" || true
done
echo "all lines: $((SECONDS - started)) s, $parallel guests at a time"
# Last, so that the tail of a long run (what CI shows) names the lines that failed.
[ -z "$failed_lines" ] || echo "lines that failed:$failed_lines (their guests' logs: $cache/<line>.out/serial.log)"
exit $failed
