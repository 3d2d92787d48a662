#!/usr/bin/env bash
# Extracts the shared libraries Mooncake's transfer engine links (libibverbs, librdmacm, libnl) into a folder,
# without root: `apt-get download` + `dpkg-deb -x`. kvpool/bench/te.py preloads them from <venv>/mooncake-sysroot.
# Idempotent; never fails: without apt-get it warns, and the tests decide whether a missing engine is a failure.
# Usage: get-mooncake-libs.sh DEST
set -u
dest=$1
debs="libnl-3-200 libnl-route-3-200 libibverbs1 librdmacm1"
[ -d "$dest/usr/lib" ] && exit 0
warn() { echo "WARNING: $1; Mooncake's transfer engine will not load (kvpool.bench.te tests skip, or fail under CI=true)." >&2; }
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    warn "no apt-get/dpkg-deb to fetch $debs"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! (cd "$tmp" && apt-get download -q $debs >/dev/null 2>"$tmp/err"); then
    warn "apt-get download $debs failed: $(tail -1 "$tmp/err")"
    exit 0
fi
mkdir -p "$tmp/root"
for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root" || { warn "dpkg-deb -x $deb failed"; exit 0; }; done
rm -rf "$dest" && mv "$tmp/root" "$dest" && echo "extracted $debs into $dest"
