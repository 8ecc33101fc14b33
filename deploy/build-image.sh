#!/usr/bin/env bash
# Build the nodesampler image with podman (or docker: BUILDER=docker), from
# wheels built here, with no registry needed, for every platform in
# NODESAMPLER_PLATFORMS (default "linux/amd64 linux/arm64"):
# - the wheels: nodesampler's own, and its pinned dependencies
#   (deploy/image-requirements.txt) downloaded here for each platform
#   (manylinux wheels of Debian 12's Python, 3.11);
# - the base image: `debian:bookworm-slim` for the host's platform, used as it
#   is when present, `debian:bookworm-slim-ARCH` for another; where no registry
#   is reachable, made with debootstrap and imported under that name
#   (NODESAMPLER_DEBOOTSTRAP=1 forces it). Another platform's root and image are
#   built by running its programs under qemu-user (binfmt_misc, registered
#   here where nothing registered it);
# - an image a platform, tagged nodesampler:VERSION-ARCH and labelled with a
#   hash of what built it (a second run with the same inputs builds nothing),
#   and the manifest list nodesampler:VERSION naming them all: what a node
#   pulls resolves to its own platform's (`podman manifest push --all
#   nodesampler:VERSION docker://REGISTRY/nodesampler:VERSION` pushes all).
# Prints the manifest list's name on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
builder=${BUILDER:-podman}
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' nodesampler/__init__.py)
image=${IMAGE:-nodesampler:$version}
platforms=${NODESAMPLER_PLATFORMS:-linux/amd64 linux/arm64}
py=${PYTHON:-.venv/bin/python}
host_arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)

# What built the image: the project's files, the pins and the Dockerfile.
inputs=$( { git ls-files -co --exclude-standard nodesampler sampler controlplane web bpf pyproject.toml README.md \
              deploy/Dockerfile deploy/image-requirements.txt | sort | xargs sha256sum; } | sha256sum | cut -c1-16)
built() {  # arch -> whether its image was built from these inputs
    [ "$("$builder" image inspect --format '{{index .Labels "nodesampler.inputs"}}' "$image-$1" 2>/dev/null)" = "$inputs" ]
}
up_to_date=1
for platform in $platforms; do built "${platform#linux/}" || up_to_date=0; done
if [ "$up_to_date" = 1 ] && { [ "$builder" != podman ] || "$builder" manifest exists "$image" 2>/dev/null; }; then
    echo "build-image: $image is up to date (inputs $inputs; $platforms)" >&2
    echo "$image"
    exit 0
fi

# Another platform's programs run under qemu-user through binfmt_misc.
foreign() {  # arch
    local machine misc=/proc/sys/fs/binfmt_misc
    case $1 in arm64) machine=aarch64 ;; *) machine=$1 ;; esac
    command -v "qemu-$machine-static" >/dev/null || {
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends qemu-user-static
    } >&2
    [ -e "$misc/register" ] || mount -t binfmt_misc binfmt_misc "$misc"
    [ -e "$misc/qemu-$machine" ] || cat "/usr/lib/binfmt.d/qemu-$machine.conf" >"$misc/register"
}

ctx=build/image-context
rm -rf "$ctx"
mkdir -p "$ctx/wheels"
cp deploy/Dockerfile deploy/image-requirements.txt "$ctx/"
echo "build-image: wheels" >&2
"$py" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$ctx/wheels" . >&2
for platform in $platforms; do
    arch=${platform#linux/}
    case $arch in arm64) machine=aarch64 ;; amd64) machine=x86_64 ;; *) echo "build-image: no platform $platform" >&2; exit 2 ;; esac
    # Two folders, two layers (deploy/Dockerfile): the dependencies', kept by
    # the builder while they do not change, and nodesampler's own.
    mkdir -p "$ctx/wheels/$arch/deps" "$ctx/wheels/$arch/nodesampler"
    cp "$ctx"/wheels/nodesampler-*.whl "$ctx/wheels/$arch/nodesampler/"
    "$py" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps -d "$ctx/wheels/$arch/deps" \
        --python-version 3.11 --implementation cp --platform "manylinux_2_28_$machine" \
        --platform "manylinux_2_17_$machine" --platform "manylinux2014_$machine" -r deploy/image-requirements.txt >&2
done

for platform in $platforms; do
    arch=${platform#linux/}
    built "$arch" && { echo "build-image: $image-$arch is up to date" >&2; continue; }
    [ "$arch" = "$host_arch" ] || foreign "$arch"
    # The base: made here when it is not (a debootstrap root, keyed by how it was made).
    base=debian:bookworm-slim
    [ "$arch" = "$host_arch" ] || base=debian:bookworm-slim-$arch
    base_key="bookworm minbase ca-certificates $arch v1"
    [ "$arch" != amd64 ] || base_key="bookworm minbase ca-certificates v1"  # as images made before arm64 were
    if [ "${NODESAMPLER_DEBOOTSTRAP:-0}" = 1 ] || ! "$builder" image exists "$base" 2>/dev/null; then
        if [ "$("$builder" image inspect --format '{{index .Labels "nodesampler.base"}}' "$base" 2>/dev/null)" != "$base_key" ]; then
            echo "build-image: making $base with debootstrap (no registry here)" >&2
            root=$(mktemp -d)
            trap 'rm -rf "$root"' EXIT
            debootstrap --arch "$arch" --variant=minbase --include=ca-certificates bookworm "$root" \
                http://deb.debian.org/debian >&2
            rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
            tar -C "$root" -c . | "$builder" import --arch "$arch" --change "LABEL nodesampler.base=$base_key" - "$base" >&2
            rm -rf "$root"
        fi
    fi
    echo "build-image: $image-$arch" >&2
    old=$("$builder" image inspect --format '{{.Id}}' "$image-$arch" 2>/dev/null || true)
    runtime=()
    [ "$builder" = podman ] && runtime=(--runtime runc)  # crun refuses hybrid cgroup hosts
    "$builder" build "${runtime[@]}" --platform "$platform" --network=host --pull=never \
        --build-arg "BASE=$base" --build-arg "ARCH=$arch" --label "nodesampler.inputs=$inputs" \
        -t "$image-$arch" "$ctx" >&2
    # The image this one replaced, now nameless: gone, so rebuilds do not fill the disk.
    if [ -n "$old" ] && [ "$old" != "$("$builder" image inspect --format '{{.Id}}' "$image-$arch")" ]; then
        "$builder" rmi "$old" >/dev/null 2>&1 || true
    fi
done

# The manifest list, made anew (an image of that name from before it: removed).
# docker makes manifest lists of pushed images alone (`docker buildx` builds
# and pushes both at once): with it, the name is the host's platform's image.
if [ "$builder" = podman ]; then
    "$builder" manifest rm "$image" >/dev/null 2>&1 || "$builder" rmi "$image" >/dev/null 2>&1 || true
    "$builder" manifest create "$image" >/dev/null
    for platform in $platforms; do
        "$builder" manifest add "$image" "containers-storage:localhost/$image-${platform#linux/}" >/dev/null
    done
else
    "$builder" tag "$image-$host_arch" "$image"
fi
echo "$image"
