// The process that holds a pod sandbox's namespaces: it waits until it is told to stop.
// Built by devkit/cluster/build.sh nodes; no image registry is reachable, so the nodes' pause
// image is made from it locally.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
