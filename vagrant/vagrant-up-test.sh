#!/usr/bin/env bash
# The Vagrant path, checked for real on a machine like ours (no systemd as
# PID 1, no usable KVM): `vagrant/vagrant-up-test.sh [GUEST...]` (default
# debian12 debian13) starts libvirt by hand inside a network namespace of its
# own (vagrant-libvirt's management network is a private-range bridge: none of
# its traffic leaves the namespace), brings each guest up from the boxes
# build-box.sh made with libvirt's qemu driver, runs the kernel tier in it
# over `vagrant ssh`, and destroys it. Exits non-zero when a guest fails to
# come up or its tests fail.
#
# Needs vagrant, vagrant-libvirt and libvirt's daemons; installs them when
# missing, and builds the boxes when `vagrant box list` lacks them.
set -euo pipefail
cd "$(dirname "$0")"
guests=${*:-debian12 debian13}
ns=nodesampler-vagrant
run=/run/nodesampler-vagrant

missing=""
for tool in vagrant:vagrant libvirtd:libvirt-daemon-system dnsmasq:dnsmasq-base; do
    command -v "${tool%%:*}" >/dev/null || missing="$missing ${tool##*:}"
done
vagrant plugin list 2>/dev/null | grep -q vagrant-libvirt || missing="$missing vagrant-libvirt"
if [ -n "$missing" ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        $missing libvirt-daemon-driver-qemu qemu-system-x86
fi
for guest in $guests; do
    vagrant box list | grep -q "^nodesampler/$guest " || bash build-box.sh "$( [ "$guest" = debian12 ] && echo bookworm || echo trixie)"
done

# vagrant-libvirt uploads a box into libvirt's pool once per box name and
# version, and would keep booting an old upload of a rebuilt box.
rm -f /var/lib/libvirt/images/nodesampler-VAGRANTSLASH-*

inns() { ip netns exec "$ns" "$@"; }
stop() {
    inns env NODESAMPLER_LIBVIRT_DRIVER=qemu vagrant destroy -f >/dev/null 2>&1 || true
    for pidfile in "$run"/*.pid; do
        [ -e "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    ip netns delete "$ns" 2>/dev/null || true
}
trap stop EXIT
ip netns delete "$ns" 2>/dev/null || true
ip netns add "$ns"
inns ip link set lo up
mkdir -p "$run"
inns virtlogd -d -p "$run/virtlogd.pid"
inns libvirtd -d -p "$run/libvirtd.pid"
for _ in $(seq 50); do inns virsh -c qemu:///system version >/dev/null 2>&1 && break; sleep 0.2; done

failed=0
printf '%-9s %-8s %-8s %s\n' guest up tests "seconds: up, tests"
for guest in $guests; do
    t0=$SECONDS
    up=ok tests=-
    inns env NODESAMPLER_LIBVIRT_DRIVER=qemu vagrant up --provider=libvirt "$guest" >"$run/$guest.up.log" 2>&1 || up=FAIL
    t1=$SECONDS
    if [ "$up" = ok ]; then
        # pytest-timeout fails a test stuck in userspace; `timeout` ends a guest
        # whose kernel is stuck (seen once under emulation: see README.md).
        inns env NODESAMPLER_LIBVIRT_DRIVER=qemu timeout 1200 vagrant ssh "$guest" -c 'cd /vagrant && sudo NODESAMPLER_REQUIRE_BPF=1 /opt/nodesampler/venv/bin/python -m pytest -q -p no:cacheprovider -o addopts= --timeout=300 -m kernel tests/test_kernel_backend.py' \
            >"$run/$guest.tests.log" 2>&1 && tests=pass || tests=FAIL
    fi
    [ "$up" = ok ] && [ "$tests" = pass ] || failed=1
    printf '%-9s %-8s %-8s %s\n' "$guest" "$up" "$tests" "$((t1 - t0)), $((SECONDS - t1))"
    [ "$up" = ok ] || tail -n 15 "$run/$guest.up.log" | sed 's/^/    /'
    [ "$tests" = - ] || grep -E '^(FAILED|ERROR) |(passed|failed|error).* in [0-9.]+s' "$run/$guest.tests.log" \
        | sed 's/^/    /'
    inns env NODESAMPLER_LIBVIRT_DRIVER=qemu vagrant destroy -f "$guest" >/dev/null 2>&1 || true
done
exit $failed
