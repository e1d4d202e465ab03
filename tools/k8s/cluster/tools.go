//go:build tools

// Package cluster pins the control-plane commands of the real-cluster test tier
// (tests/k8s/realcluster.py): kube-scheduler, kube-controller-manager and kubectl,
// built by tools/k8s/build.sh with `go build k8s.io/kubernetes/cmd/NAME` inside this
// module, so the k8s.io/* staging modules come at the same v0.37.2 pins as the API
// server's (tools/k8s/apiserver). The imports below only make `go mod tidy` record
// what those commands need; this file is never compiled.
package cluster

import (
	_ "k8s.io/client-go/plugin/pkg/client/auth"
	_ "k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	_ "k8s.io/kubectl/pkg/cmd"
	_ "k8s.io/kubectl/pkg/cmd/util"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	_ "k8s.io/kubernetes/cmd/kube-scheduler/app"
)
