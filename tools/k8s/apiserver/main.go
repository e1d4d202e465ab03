// Command kube-apiserver is the upstream API server, built from the
// k8s.io/kubernetes module for slotctl's real-API-server test tier
// (tests/k8s/realapi.py). It is the same entry point as
// k8s.io/kubernetes/cmd/kube-apiserver.
package main

import (
	"os"
	_ "time/tzdata"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	command := app.NewAPIServerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
