#!/usr/bin/env bash
# Builds the control plane of the real Kubernetes test tiers (tests/k8s/realapi.py,
# tests/k8s/realcluster.py) as ONE binary, slotctl-k8s (tools/k8s/cluster/main.go), with
# one `go build` in one Go module (tools/k8s/cluster/go.mod: k8s.io/kubernetes v1.37.2,
# every k8s.io/* staging module pinned to v0.37.2), so each package compiles once and
# there is one link. It runs, each by its upstream main:
#   kube-apiserver, kube-scheduler, kube-controller-manager, kubectl
#                 (k8s.io/kubernetes/cmd/NAME)
#   etcd          (go.etcd.io/etcd/server/v3/etcdmain, ETCD_VERSION: the API server's
#                 storage; the apiserver already compiles its client)
#   kwok          (sigs.k8s.io/kwok/cmd/kwok, KWOK_VERSION: simulated nodes and pods,
#                 built against the same k8s.io versions as the rest)
# chosen by the name it is called by: each NAME is a symlink to slotctl-k8s.
# Everything goes to ${SLOTCTL_K8S_CACHE:-~/.cache/slotctl/k8s}/<version key>/, so only
# the first run on a machine pays the build. Prints that directory on success, and the
# build's wall time on stderr. A second run while one is building waits for it (a lock in
# the directory; it also puts a build started at a low priority back to normal) and then
# builds only what is still missing.
#
#   tools/k8s/build.sh            build what is missing
#   tools/k8s/build.sh --force    rebuild
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.7.0
KWOK_VERSION=v0.8.0
NAMES=(kube-apiserver etcd kube-scheduler kube-controller-manager kubectl kwok)
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${SLOTCTL_K8S_CACHE:-$HOME/.cache/slotctl/k8s}/${K8S_VERSION}-etcd-${ETCD_VERSION}-kwok-${KWOK_VERSION}"
force=0
if [[ "${1:-}" == "--force" ]]; then force=1; shift; fi
[[ $# == 0 ]] || { echo "usage: build.sh [--force]" >&2; exit 2; }

command -v go >/dev/null || { echo "build.sh: no go on PATH" >&2; exit 2; }
# The version key names what go.mod builds: refuse a go.mod that says otherwise.
for pin in "k8s.io/kubernetes $K8S_VERSION" "go.etcd.io/etcd/server/v3 $ETCD_VERSION" \
    "sigs.k8s.io/kwok $KWOK_VERSION"; do
    grep -Eq "^[[:space:]]+$pin\$" "$here/cluster/go.mod" ||
        { echo "build.sh: tools/k8s/cluster/go.mod does not require $pin" >&2; exit 2; }
done
mkdir -p "$out"
exec 9>>"$out/.lock"
if ! flock -n 9; then
    holder="$(cat "$out/.lock" 2>/dev/null || true)"
    echo "build.sh: waiting for the build already running into $out (pid ${holder:-?})" >&2
    # That build is now what this one's caller waits on: back to normal priority if it
    # was started at a low one (as .ci/run starts it; raising a priority needs root,
    # elsewhere it stays as it is).
    pgid="$(ps -o pgid= -p "${holder:-0}" 2>/dev/null | tr -d ' ' || true)"
    [[ -z $pgid ]] || renice -n 0 -g "$pgid" >/dev/null 2>&1 || true
    flock 9
fi
echo $$ >"$out/.lock"

built() {
    [[ -x "$out/slotctl-k8s" && -f "$out/kwok-stages.yaml" ]] || return 1
    local name
    for name in "${NAMES[@]}"; do [[ -x "$out/$name" ]] || return 1; done
}

if [[ $force == 1 ]] || ! built; then
    echo "build.sh: building slotctl-k8s (${NAMES[*]}) into $out" >&2
    start=$SECONDS
    export GOFLAGS="${GOFLAGS:-} -buildvcs=false"
    # Static (no cgo) and stripped (no symbol table, no DWARF: a smaller, faster link).
    # Since the link drops DWARF, the compiler makes none (-dwarf=false: the same code,
    # about 11% less compile CPU measured).
    (cd "$here/cluster" && CGO_ENABLED=0 go build -trimpath -gcflags=all=-dwarf=false \
        -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION" \
        -o "$out/slotctl-k8s.tmp" .)
    mv "$out/slotctl-k8s.tmp" "$out/slotctl-k8s"
    for name in "${NAMES[@]}"; do ln -sfn slotctl-k8s "$out/$name"; done

    # kwok simulates nothing without stages: its own "fast" ones as released (nodes
    # initialized and kept Ready with leases; pods Running with an IP, completed,
    # deleted), beside the binary (tests/k8s/realcluster.py passes them with --config).
    src="$(cd "$here/cluster" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage"
    for f in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
        pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
        echo "---"
        cat "$src/$f.yaml"
    done >"$out/kwok-stages.yaml.tmp"
    mv "$out/kwok-stages.yaml.tmp" "$out/kwok-stages.yaml"
    echo "build.sh: built in $((SECONDS - start))s" >&2
fi

echo "$out"
