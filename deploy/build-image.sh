#!/usr/bin/env bash
# Build the nodesampler image with podman (or docker: BUILDER=docker), from
# wheels built here, with no registry needed:
# - the wheels: nodesampler's own, and its pinned dependencies
#   (deploy/image-requirements.txt) downloaded here;
# - the base image (`FROM debian:bookworm-slim`): used as it is when present;
#   where no registry is reachable, made with debootstrap and imported under
#   that name (NODESAMPLER_DEBOOTSTRAP=1 forces it);
# - the image, tagged nodesampler:VERSION and labelled with a hash of what
#   built it: a second run with the same inputs builds nothing.
# Prints the image's name on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
builder=${BUILDER:-podman}
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' nodesampler/__init__.py)
image=${IMAGE:-nodesampler:$version}
base=debian:bookworm-slim
py=${PYTHON:-.venv/bin/python}

# What built the image: the project's files, the pins and the Dockerfile.
inputs=$( { git ls-files -co --exclude-standard nodesampler sampler controlplane web bpf pyproject.toml README.md \
              deploy/Dockerfile deploy/image-requirements.txt | sort | xargs sha256sum; } | sha256sum | cut -c1-16)
if [ "$("$builder" image inspect --format '{{index .Labels "nodesampler.inputs"}}' "$image" 2>/dev/null)" = "$inputs" ]; then
    echo "build-image: $image is up to date (inputs $inputs)" >&2
    echo "$image"
    exit 0
fi

ctx=build/image-context
rm -rf "$ctx"
mkdir -p "$ctx/wheels"
cp deploy/Dockerfile deploy/image-requirements.txt "$ctx/"
echo "build-image: wheels" >&2
"$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$ctx/wheels" . >&2
"$py" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps -d "$ctx/wheels" \
    -r deploy/image-requirements.txt >&2

# The base: made here when it is not (a debootstrap root, keyed by how it was made).
base_key="bookworm minbase ca-certificates v1"
if [ "${NODESAMPLER_DEBOOTSTRAP:-0}" = 1 ] || ! "$builder" image exists "$base" 2>/dev/null; then
    if [ "$("$builder" image inspect --format '{{index .Labels "nodesampler.base"}}' "$base" 2>/dev/null)" != "$base_key" ]; then
        echo "build-image: making $base with debootstrap (no registry here)" >&2
        root=$(mktemp -d)
        trap 'rm -rf "$root"' EXIT
        debootstrap --variant=minbase --include=ca-certificates bookworm "$root" http://deb.debian.org/debian >&2
        rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
        tar -C "$root" -c . | "$builder" import --change "LABEL nodesampler.base=$base_key" - "$base" >&2
    fi
fi

echo "build-image: $image" >&2
old=$("$builder" image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
runtime=()
[ "$builder" = podman ] && runtime=(--runtime runc)  # crun refuses hybrid cgroup hosts
"$builder" build "${runtime[@]}" --network=host --pull=never --label "nodesampler.inputs=$inputs" \
    -t "$image" "$ctx" >&2
# The image this one replaced, now nameless: gone, so rebuilds do not fill the disk.
if [ -n "$old" ] && [ "$old" != "$("$builder" image inspect --format '{{.Id}}' "$image")" ]; then
    "$builder" rmi "$old" >/dev/null 2>&1 || true
fi
echo "$image"
