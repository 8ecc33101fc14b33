#!/bin/sh
# The one place that prepares a Debian guest for the kernel tests, used by
# all three paths: `vagrant up` (the Vagrantfile runs it in the guest),
# build-box.sh and run-tests.sh (both run it in the guest's root through
# chroot while building, so a box or an image boots ready and offline).
#
#   provision.sh                 packages, the headers of the running kernel,
#                                the project in /opt/nodesampler/venv
#   provision.sh --packages      the Debian packages a guest image is built
#                                with (its kernel and that kernel's headers
#                                included), one line, for debootstrap
#   provision.sh --kernel VER    headers for VER rather than `uname -r` (in a
#                                chroot, uname -r is the host's kernel)
#   provision.sh --no-project    the virtualenv without the project (an image
#                                whose checkout only arrives at boot)
#
# NODESAMPLER_SRC: the checkout (default /vagrant). apt is asked only for what
# is missing, so a second run in a prepared guest needs no network.
set -eu

# The kernel tier needs bcc, numpy and pytest, and aiohttp and cryptography
# for the pods test's kubelet over TLS (all Debian's, matched to the guest's
# Python; python3-cffi-backend named because debootstrap does not resolve
# the virtual package cryptography depends on); procps, util-linux and kmod
# for the tests' own tools.
PACKAGES="python3-bpfcc python3-numpy python3-prometheus-client python3-aiohttp python3-cryptography python3-cffi-backend python3-pytest python3-pytest-timeout python3-venv python3-pip python3-setuptools procps util-linux kmod"

kernel=$(uname -r)
project=1
while [ $# -gt 0 ]; do
    case $1 in
        --packages) echo "linux-image-amd64 linux-headers-amd64 $PACKAGES" | tr ' ' ,; exit 0 ;;
        --kernel) kernel=$2; shift ;;
        --no-project) project=0 ;;
        *) echo "provision.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

wanted="$PACKAGES linux-headers-$kernel"
missing=""
for p in $wanted; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    echo "provision: installing$missing"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

# bcc finds a kernel's headers through /lib/modules/VER/build; Debian's
# headers package makes that link, a hand-built kernel may not.
if [ ! -e "/lib/modules/$kernel/build" ]; then
    echo "provision: no headers for $kernel at /lib/modules/$kernel/build" >&2
    exit 1
fi

# Debian's bcc is only importable from its own Python: the venv sees the system
# site-packages, and the project goes in without dependencies (the kernel tier
# needs none beyond the packages above, and the guest may have no network;
# prometheus-client is the agent's own parser for engines' metrics).
venv=/opt/nodesampler/venv
[ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages --without-pip "$venv"
if [ "$project" = 1 ]; then
    src=${NODESAMPLER_SRC:-/vagrant}
    "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation --no-index -e "$src"
fi
"$venv/bin/python" -c 'import bcc, numpy, prometheus_client, pytest' && echo "provision: ready for kernel $kernel"
