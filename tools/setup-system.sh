#!/usr/bin/env bash
# Install the Debian packages FanStore needs, only those that are missing.
#   libfuse3-dev pkg-config: to build pyfuse3;  fuse3: fusermount3 and the FUSE runtime.
#   tar zip gzip bzip2 xz-utils zstd: the tests build real archives with them.
# Idempotent and quiet when everything is there. Needs root (or sudo) only to install.
set -euo pipefail
pkgs=(libfuse3-dev fuse3 pkg-config tar zip gzip bzip2 xz-utils zstd)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "setup: missing system packages ${missing[*]} and no apt-get here; install them by hand" >&2
    exit 1
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then sudo=(sudo); else
        echo "setup: need root to install ${missing[*]} (run as root or install them by hand)" >&2
        exit 1
    fi
fi
echo "setup: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
