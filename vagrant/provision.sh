#!/bin/sh
# The one place that prepares a Debian guest for the kernel tests, used by
# all three paths: `vagrant up` (the Vagrantfile runs it in the guest),
# build-box.sh and run-tests.sh (both run it in the guest's root through
# chroot while building, so a box or an image boots ready and offline).
#
#   provision.sh                   packages, the running kernel's headers
#                                  downloaded (not installed), the project in
#                                  /opt/nodesampler/venv
#   provision.sh --packages        the Debian packages a guest root is made
#                                  with (no kernel, no headers), one line, for
#                                  debootstrap
#   provision.sh --kernel-from S   install Debian suite S's kernel (a root
#                                  being built has none; in a chroot, uname -r
#                                  is the host's): its own suite's, or an older
#                                  one's under the agent's userland
#   provision.sh --no-project      the virtualenv without the project (an
#                                  image whose checkout only arrives at boot)
#
# The guest has no kernel headers installed: the kernel tier runs as on a
# machine without any (the backend compiles against bpf/include/). The
# kernel's headers packages wait in /var/cache/nodesampler/headers; the guest
# unpacks them after the tier and checks the backend compiles against them
# too (--kernel-headers installed).
#
# NODESAMPLER_SRC: the checkout (default /vagrant). apt is asked only for what
# is missing, so a second run in a prepared guest needs no network.
set -eu

# The kernel tier needs bcc, numpy and pytest, and aiohttp and cryptography
# for the pods test's kubelet over TLS (all Debian's, matched to the guest's
# Python; python3-cffi-backend named because debootstrap does not resolve
# the virtual package cryptography depends on); procps, util-linux and kmod
# for the tests' own tools; gcc and libc6-dev for the publication test's
# reader in C (tests/ring_reader.c); libatomic1 for the agent's fence on a
# weakly ordered CPU (sampler/kernel/memory_order.py).
PACKAGES="python3-bpfcc python3-numpy python3-prometheus-client python3-aiohttp python3-cryptography python3-cffi-backend python3-pytest python3-pytest-timeout python3-venv python3-pip python3-setuptools procps util-linux kmod gcc libc6-dev libatomic1"

# The archive's snapshot may be older than a Release's Valid-Until (unstable's
# is a week): what it serves is taken as it is.
apt_update="-o Acquire::Check-Valid-Until=false"
kernel=$(uname -r)
kernel_from=""
project=1
while [ $# -gt 0 ]; do
    case $1 in
        --packages) echo "$PACKAGES" | tr ' ' ,; exit 0 ;;
        --kernel-from) kernel_from=$2; shift ;;
        --no-project) project=0 ;;
        *) echo "provision.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

missing=""
for p in $PACKAGES; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "provision: installing$missing"
    apt-get update -q $apt_update
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

updated=""
[ -z "$missing" ] || updated=1
if [ -n "$kernel_from" ]; then
    # Another suite's kernel is found through that suite's archive, added
    # beside the root's own; apt then takes the kernel from it by name.
    if ! grep -q -s -E "^deb .* $kernel_from main" /etc/apt/sources.list /etc/apt/sources.list.d/*.list; then
        mirror=$(awk '$1 == "deb" { print $2; exit }' /etc/apt/sources.list)
        echo "deb ${mirror:-http://deb.debian.org/debian} $kernel_from main" >/etc/apt/sources.list.d/kernel.list
    fi
    apt-get update -q $apt_update
    updated=1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "linux-image-$(dpkg --print-architecture)/$kernel_from"
    kernel=$(ls /lib/modules)
    [ "$(echo "$kernel" | wc -w)" = 1 ] || { echo "provision: one kernel expected, found: $kernel" >&2; exit 1; }
fi

# The kernel's headers, as its two Debian packages (the arch's and the common
# one it depends on), downloaded but not installed.
headers=/var/cache/nodesampler/headers
if ! ls "$headers"/linux-headers-"$kernel"_*.deb >/dev/null 2>&1; then
    mkdir -p "$headers"
    [ -n "$updated" ] || apt-get update -q $apt_update
    common=$(apt-cache depends "linux-headers-$kernel" | sed -n 's/^ *Depends: \(linux-headers-.*-common[^ ]*\)$/\1/p' | head -n 1)
    (cd "$headers" && apt-get download -q "linux-headers-$kernel" $common) || {
        echo "provision: cannot download the headers of $kernel" >&2
        exit 1
    }
fi

# Debian's bcc is only importable from its own Python: the venv sees the system
# site-packages, and the project goes in without dependencies (the kernel tier
# needs none beyond the packages above, and the guest may have no network;
# prometheus-client is the agent's own parser for engines' metrics).
venv=/opt/nodesampler/venv
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages --without-pip "$venv"
# google-re2 (selectors' regexes) and msgspec (the wire's schema) are no Debian
# packages: from wheels given in NODESAMPLER_WHEELS (vagrant/run-tests.sh
# downloads them), else from PyPI.
if ! "$venv/bin/python" -c 'import re2, msgspec' 2>/dev/null; then
    if [ -n "${NODESAMPLER_WHEELS:-}" ]; then
        PIP_CERT= PIP_FIND_LINKS= "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
            --no-index --find-links "$NODESAMPLER_WHEELS" google-re2 msgspec
    else
        PIP_CERT= "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps google-re2 msgspec  # pip's own CAs
    fi
fi
if [ "$project" = 1 ]; then
    src=${NODESAMPLER_SRC:-/vagrant}
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation --no-index -e "$src"
fi
"$venv/bin/python" -c 'import bcc, msgspec, numpy, prometheus_client, pytest, re2' && echo "provision: ready for kernel $kernel"
