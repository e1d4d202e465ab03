#!/usr/bin/env bash
# Builds the real API server test tier's binaries (tests/k8s/realapi.py):
# kube-apiserver from the k8s.io/kubernetes module (tools/k8s/apiserver, a
# consumer module whose go.mod pins the k8s.io/* staging modules) and kine
# (github.com/k3s-io/kine, SQLite) as its storage. Both are cached under
# ${SLOTCTL_K8S_CACHE:-~/.cache/slotctl/k8s}/<version>/ so only the first run
# on a machine pays the build. Prints the cache directory on success.
#
#   tools/k8s/build.sh            build what is missing
#   tools/k8s/build.sh --force    rebuild both
set -euo pipefail

K8S_VERSION=v1.37.2
KINE_VERSION=v0.17.5
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${SLOTCTL_K8S_CACHE:-$HOME/.cache/slotctl/k8s}/${K8S_VERSION}-kine-${KINE_VERSION}"
force=0
[[ "${1:-}" == "--force" ]] && force=1

command -v go >/dev/null || { echo "build.sh: no go on PATH" >&2; exit 2; }
mkdir -p "$out"
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"

if [[ $force == 1 || ! -x "$out/kube-apiserver" ]]; then
    echo "build.sh: building kube-apiserver $K8S_VERSION into $out" >&2
    start=$SECONDS
    (cd "$here/apiserver" && CGO_ENABLED=0 go build -trimpath \
        -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION" \
        -o "$out/kube-apiserver.tmp" .)
    mv "$out/kube-apiserver.tmp" "$out/kube-apiserver"
    echo "build.sh: kube-apiserver built in $((SECONDS - start))s" >&2
fi

if [[ $force == 1 || ! -x "$out/kine" ]]; then
    echo "build.sh: building kine $KINE_VERSION into $out" >&2
    start=$SECONDS
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    # kine's go.mod has no replace lines, so `go install pkg@version` builds it
    # exactly as released. With gcc, cgo builds k3s's SQLite driver (mattn/go-sqlite3);
    # without it kine falls back to the pure-Go modernc.org/sqlite.
    cgo=0
    command -v gcc >/dev/null && cgo=1
    GOBIN="$tmp" CGO_ENABLED=$cgo go install -trimpath -ldflags "-s -w" \
        "github.com/k3s-io/kine@$KINE_VERSION"
    mv "$tmp/kine" "$out/kine"
    echo "build.sh: kine built in $((SECONDS - start))s" >&2
fi

echo "$out"
