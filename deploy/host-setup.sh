#!/usr/bin/env bash
# `make setup` (deploy/host-setup.sh): install what this host lacks to run
# nodesampler, and nothing when nothing is missing. `make test` runs it with
# `test`: also what only the tests need. Debian/Ubuntu, as root for the apt part.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}

arch=$(dpkg --print-architecture)
# python3-bpfcc: bcc has no PyPI release, so the virtualenv sees the system's.
# No kernel headers: the programs compile against the few bpf/include/ ships.
packages="python3-venv python3-pip python3-bpfcc"
extra=""
if [ "$mode" = test ]; then
    # iproute2 and nftables: the fleet test builds its own network of namespaces.
    # prometheus (with promtool): the export is checked by a real Prometheus.
    # prometheus-alertmanager: a real Alertmanager posts the shipped rules' alerts to the incident receiver.
    # chromium: the page tests drive a real headless browser (playwright, without its own browser download).
    # qemu-system-x86: the VM harness's hang report is tested against a real QEMU monitor.
    # podman, runc, debootstrap: the image is built here (its base made with
    # debootstrap: no registry) and the manifests' pods run in it (runc: crun
    # refuses hybrid cgroup hosts).
    # linux-headers-$arch: the kernel backend is also tested compiling against
    # the distribution's headers (--kernel-headers installed).
    # kubectl: its kustomize renders every combination of the shipped manifests' components.
    packages="$packages iproute2 nftables prometheus prometheus-alertmanager chromium qemu-system-x86 podman runc debootstrap linux-headers-$arch kubectl"
    extra="[test]"
fi
if [ "$mode" = bench ]; then
    # wrk: bench/heartbeat_throughput.py's load generator (a C client, so the client is not what is measured).
    packages="$packages wrk"
    extra="[test]"
fi
missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "setup: missing Debian packages:$missing (run as root, or install them)" >&2
        exit 1
    fi
    echo "setup: installing$missing"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

# For those tests, a kernel without headers of its own (a VM kernel built
# elsewhere) gets the distribution's: bcc looks in /lib/modules/$(uname -r)/
# {build,source}, and Debian splits the headers in two packages, so both links.
mod=/lib/modules/$(uname -r)
if [ "$mode" = test ] && [ ! -e "$mod/build" ] && [ "$(id -u)" = 0 ]; then
    hdr=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$hdr" ] && [ -d "${hdr%-$arch}-common" ]; then
        echo "setup: linking $mod/{build,source} to $hdr (the running kernel ships no headers)"
        mkdir -p "$mod"
        ln -sfn "$hdr" "$mod/build"
        ln -sfn "${hdr%-$arch}-common" "$mod/source"
    fi
fi

# The virtualenv comes from the system Python, which is the one bcc is built for.
if [ ! -x .venv/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=".venv/.installed$extra-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -e "$stamp" ] && [ ! -e ".venv/.installed[test]-${stamp##*-}" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -e ".$extra"
    rm -f .venv/.installed*
    touch "$stamp"
fi

# The cluster's audit tools, for the manifests' test (tests/test_audit.py):
# checkov and kubernetes-validate, pinned, in a virtualenv of their own
# (checkov pins dozens of libraries of its own, some against the tests').
if [ "$mode" = test ]; then
    audit_stamp=".venv-audit/.installed-$(sha256sum < deploy/audit-requirements.txt | cut -c1-16)"
    if [ ! -e "$audit_stamp" ]; then
        /usr/bin/python3 -m venv .venv-audit
        .venv-audit/bin/pip install -q --disable-pip-version-check -r deploy/audit-requirements.txt
        rm -f .venv-audit/.installed*
        touch "$audit_stamp"
    fi
fi
