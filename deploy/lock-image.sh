#!/usr/bin/env bash
# Re-pin deploy/image-requirements.txt: what `pip install .` resolves today
# for the image's Python (Debian 12's 3.11, the same as this host's /usr/bin/python3).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
/usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check .
{
    echo "# What the image installs besides Debian's python3-bpfcc, pinned: the exact versions"
    echo "# that 'pip install .' resolves for Python 3.11 (Debian 12). Regenerate: deploy/lock-image.sh"
    "$venv/bin/pip" freeze --exclude nodesampler
} > deploy/image-requirements.txt
