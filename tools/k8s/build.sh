#!/usr/bin/env bash
# Builds the real Kubernetes test tiers' binaries (tests/k8s/realapi.py,
# tests/k8s/realcluster.py), all from the k8s.io/kubernetes v1.37.2 module with the
# k8s.io/* staging modules pinned to v0.37.2 by consumer modules' go.mod:
#   kube-apiserver            (tools/k8s/apiserver/main.go: app.NewAPIServerCommand)
#   kube-scheduler, kube-controller-manager, kubectl
#                             (go build k8s.io/kubernetes/cmd/NAME in tools/k8s/cluster,
#                             whose go.mod has the apiserver's pins plus what these need)
#   kine                      (github.com/k3s-io/kine, SQLite) as the API server's storage
#   kwok                      (sigs.k8s.io/kwok/cmd/kwok: simulated nodes and pods)
# All go to ${SLOTCTL_K8S_CACHE:-~/.cache/slotctl/k8s}/<version>/ so only the first
# run on a machine pays the build. Prints the cache directory on success, and each
# build's wall time on stderr.
#
#   tools/k8s/build.sh            build what is missing
#   tools/k8s/build.sh --force    rebuild all
#   tools/k8s/build.sh NAME...    build only these (missing ones), e.g. kube-apiserver kine
set -euo pipefail

K8S_VERSION=v1.37.2
KINE_VERSION=v0.17.5
KWOK_VERSION=v0.8.0
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${SLOTCTL_K8S_CACHE:-$HOME/.cache/slotctl/k8s}/${K8S_VERSION}-kine-${KINE_VERSION}"
force=0
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
wanted=("$@")
[[ ${#wanted[@]} == 0 ]] && wanted=(kube-apiserver kine kube-scheduler kube-controller-manager kubectl kwok)

command -v go >/dev/null || { echo "build.sh: no go on PATH" >&2; exit 2; }
mkdir -p "$out"
export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
version_flags="-X k8s.io/component-base/version.gitVersion=$K8S_VERSION"

# A k8s.io/kubernetes command, built inside a consumer module so its pins apply.
build_kube() {
    local name=$1 pkg=$2 module=$3
    (cd "$here/$module" && CGO_ENABLED=0 go build -trimpath \
        -ldflags "-s -w $version_flags" -o "$out/$name.tmp" "$pkg")
    mv "$out/$name.tmp" "$out/$name"
}

# A module built exactly as released (its go.mod has no replace lines, so
# `go install pkg@version` works).
install_module() {
    local name=$1 pkg=$2 cgo=$3
    GOBIN="$tmp" CGO_ENABLED=$cgo go install -trimpath -ldflags "-s -w" "$pkg"
    mv "$tmp/$name" "$out/$name"
}

build_one() {
    case $1 in
        kube-apiserver) build_kube kube-apiserver . apiserver ;;
        kube-scheduler | kube-controller-manager | kubectl)
            build_kube "$1" "k8s.io/kubernetes/cmd/$1" cluster ;;
        # With gcc, cgo builds k3s's SQLite driver (mattn/go-sqlite3); without it
        # kine falls back to the pure-Go modernc.org/sqlite.
        kine) install_module kine "github.com/k3s-io/kine@$KINE_VERSION" "$(command -v gcc >/dev/null && echo 1 || echo 0)" ;;
        kwok) install_module kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" 0 ;;
        *) echo "build.sh: unknown binary $1" >&2; exit 2 ;;
    esac
}

# kwok simulates nothing without stages: its own "fast" ones as released (nodes
# initialized and kept Ready with leases; pods Running with an IP, completed, deleted),
# beside the binary (tests/k8s/realcluster.py passes them with --config).
kwok_stages() {
    local src
    src="$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage"
    [[ -d "$src" ]] || go mod download "sigs.k8s.io/kwok@$KWOK_VERSION"
    for f in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
        pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
        echo "---"
        cat "$src/$f.yaml"
    done >"$out/kwok-stages.yaml.tmp"
    mv "$out/kwok-stages.yaml.tmp" "$out/kwok-stages.yaml"
}

for name in "${wanted[@]}"; do
    if [[ $force == 1 || ! -x "$out/$name" ]]; then
        echo "build.sh: building $name into $out" >&2
        start=$SECONDS
        build_one "$name"
        echo "build.sh: $name built in $((SECONDS - start))s" >&2
    fi
    if [[ $name == kwok && ($force == 1 || ! -f "$out/kwok-stages.yaml") ]]; then
        kwok_stages
    fi
done

echo "$out"
