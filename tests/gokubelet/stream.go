// The stream side of gokubelet (-stream): the same device manager, driven
// line by line by whoever runs it, for scenarios that change the host while
// the plugin serves (tests/guest_plugin.py in the real-kernel guest).
//
// Events are printed on stdout as they happen, one JSON object a line, each
// with "at", the Unix time in seconds:
//
//	{"event": "registered", "resource": R}
//	{"event": "list", "resource": R, "devices": [{"id", "health", "numa"}]}
//	{"event": "allocated", "resource": R, "ids": [...], "containers": [...], "error": ""}
//	{"event": "end", "errors": [...]}
//
// Commands are read from stdin: `allocate RESOURCE ID[,ID...]` calls Allocate
// on the resource's connection; `quit` (or the end of stdin) stops the kubelet
// and ends with the "end" event.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/status"
)

var stream = flag.Bool("stream", false, "print each registration and device list as a JSON line, and take commands on stdin")

type emitter struct {
	mu  sync.Mutex
	out *json.Encoder
}

func (e *emitter) emit(event map[string]interface{}) {
	event["at"] = float64(time.Now().UnixNano()) / 1e9
	e.mu.Lock()
	defer e.mu.Unlock()
	_ = e.out.Encode(event)
}

func runStream(k *kubelet) int {
	e := &emitter{out: json.NewEncoder(os.Stdout)}
	k.mu.Lock()
	k.onEvent = e.emit
	k.mu.Unlock()
	if err := k.start(); err != nil {
		fmt.Fprintln(os.Stderr, "gokubelet:", err)
		return 1
	}
	lines := bufio.NewScanner(os.Stdin)
	for lines.Scan() {
		words := strings.Fields(lines.Text())
		if len(words) == 0 {
			continue
		}
		if words[0] == "quit" {
			break
		}
		if words[0] != "allocate" || len(words) != 3 {
			k.failf("unknown command %q", lines.Text())
			continue
		}
		name, ids := words[1], strings.Split(words[2], ",")
		k.mu.Lock()
		var ep *endpoint
		if r := k.res[name]; r != nil {
			ep = r.ep
		}
		k.mu.Unlock()
		event := map[string]interface{}{"event": "allocated", "resource": name, "ids": ids, "error": ""}
		if ep == nil {
			event["error"] = "not registered"
		} else if containers, err := allocate(ep, ids); err != nil {
			st := status.Convert(err)
			event["error"] = fmt.Sprintf("%s: %s", st.Code(), st.Message())
		} else {
			event["containers"] = containers
		}
		e.emit(event)
	}
	k.stop()
	k.mu.Lock()
	errs := append([]string{}, k.errors...)
	k.mu.Unlock()
	e.emit(map[string]interface{}{"event": "end", "errors": errs})
	return 0
}
