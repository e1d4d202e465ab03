// Command slotctl-k8s is the control plane of slotctl's real Kubernetes test tiers
// (tests/k8s/realapi.py, tests/k8s/realcluster.py) in one binary, as k3s does it: the
// upstream entry points of kube-apiserver, kube-scheduler, kube-controller-manager and
// kubectl (k8s.io/kubernetes v1.37.2), kwok (sigs.k8s.io/kwok/cmd/kwok) and etcd
// (go.etcd.io/etcd/server/v3/etcdmain, the API server's storage), each main as upstream
// writes it. One binary is one `go build`: every package compiles once, against one
// set of k8s.io versions, and there is one link (tools/k8s/build.sh).
//
// It runs the command its name says (a symlink named kube-apiserver, ...), or the one
// its first argument names: `slotctl-k8s kubectl get pods`.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	_ "time/tzdata" // for timeZone support in CronJob (kube-apiserver, kube-controller-manager)

	"github.com/spf13/pflag"
	"go.etcd.io/etcd/server/v3/etcdmain"
	_ "k8s.io/client-go/plugin/pkg/client/auth" // kubectl's auth plugins
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // for JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // load all the prometheus client-go plugins
	_ "k8s.io/component-base/metrics/prometheus/version"  // for version metric registration
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kwokconfig "sigs.k8s.io/kwok/pkg/config"
	kwok "sigs.k8s.io/kwok/pkg/kwok/cmd"
	kwoklog "sigs.k8s.io/kwok/pkg/log"
	kwoksignals "sigs.k8s.io/kwok/pkg/utils/signals"
)

// Each returns the exit code; the bodies are the upstream mains (cmd/NAME/NAME.go).
var commands = map[string]func() int{
	"kube-apiserver":          func() int { return cli.Run(apiserver.NewAPIServerCommand()) },
	"kube-scheduler":          func() int { return cli.Run(scheduler.NewSchedulerCommand()) },
	"kube-controller-manager": func() int { return cli.Run(controllermanager.NewControllerManagerCommand()) },
	"kubectl":                 runKubectl,
	"kwok":                    runKwok,
	"etcd":                    func() int { etcdmain.Main(os.Args); return 0 },
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := commands[name]; !ok && len(os.Args) > 1 {
		os.Args = os.Args[1:] // slotctl-k8s NAME ARGS...: run NAME as if called so
		name = os.Args[0]
	}
	run, ok := commands[name]
	if !ok {
		names := make([]string, 0, len(commands))
		for n := range commands {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprintf(os.Stderr, "usage: slotctl-k8s COMMAND [ARGS...] (or a link named COMMAND)\ncommands: %s\n",
			strings.Join(names, ", "))
		os.Exit(2)
	}
	os.Exit(run())
}

// withoutVersionFlag takes component-base's --version (verflag: the kube commands'
// packages register it on pflag.CommandLine when they load, and cobra adds that set to
// every root command) out of the global flags, so that kubectl and kwok have their
// own flags only, as their own binaries do (kwok's --version is its own).
func withoutVersionFlag() {
	flags := pflag.NewFlagSet(os.Args[0], pflag.ExitOnError)
	pflag.CommandLine.VisitAll(func(f *pflag.Flag) {
		if f.Name != "version" {
			flags.AddFlag(f)
		}
	})
	pflag.CommandLine = flags
}

// k8s.io/kubernetes/cmd/kubectl/kubectl.go
func runKubectl() int {
	withoutVersionFlag()
	logs.GlogSetter(kubectl.GetLogVerbosity(os.Args)) // nolint:errcheck
	command := kubectl.NewDefaultKubectlCommand()
	if err := cli.RunNoErrOutput(command); err != nil {
		kubectlutil.CheckErr(err) // exits
	}
	return 0
}

// sigs.k8s.io/kwok/cmd/kwok/main.go
func runKwok() int {
	withoutVersionFlag()
	flagset := pflag.NewFlagSet("global", pflag.ContinueOnError)
	flagset.ParseErrorsAllowlist.UnknownFlags = true
	flagset.Usage = func() {}

	ctx := kwoksignals.SetupSignalContext()
	ctx, logger := kwoklog.InitFlags(ctx, flagset)
	ctx, err := kwokconfig.InitFlags(ctx, flagset)
	if err != nil {
		_, _ = os.Stderr.Write([]byte(flagset.FlagUsages()))
		logger.Error("Init config flags", "err", err)
		return 1
	}
	command := kwok.NewCommand(ctx)
	command.PersistentFlags().AddFlagSet(flagset)
	if err := command.ExecuteContext(ctx); err != nil {
		logger.Error("Execute exit", "err", err)
		return 1
	}
	return 0
}
