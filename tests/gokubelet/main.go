// gokubelet is a minimal kubelet device manager on grpc-go, the gRPC stack of
// the real kubelet, used to check dp-server against it (tests/test_gokubelet.py)
// and to time Allocate without the Python client's own cost
// (bench/bench_serve.py --kubelet go).
//
// It does what the kubelet's device manager does, and nothing else: it serves
// v1beta1.Registration on <dir>/kubelet.sock; each Register dials the plugin's
// endpoint synchronously (blocking dial, :authority localhost), asks
// GetDevicePluginOptions, starts ListAndWatch and only then replies. After
// -expect resources have sent their first device list it runs the scenario the
// flags ask for and prints one JSON report on stdout.
//
// With -pod-resources it also serves the kubelet's PodResources List API on
// that socket, from its pods (pods.go: the device manager's checkpoint, a
// kubelet's start-up, admissions); with -pod-resources-only it serves only
// that, with no pods, until it is killed. With -stream it prints each
// registration and device list as it comes and takes commands (stream.go).
//
// Messages are encoded by hand (a few fields each) so that the program builds
// from Debian's grpc-go package alone, with no protoc step.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

// ---------------------------------------------------------------- wire format

type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	switch m := v.(type) {
	case *[]byte:
		return *m, nil
	case []byte:
		return m, nil
	}
	return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	m, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*m = append((*m)[:0], data...)
	return nil
}

func (rawCodec) Name() string   { return "proto" }
func (rawCodec) String() string { return "proto" }

type field struct {
	num    int
	varint uint64
	bytes  []byte
}

func readVarint(b []byte) (uint64, int, error) {
	var v uint64
	for i := 0; i < len(b) && i < 10; i++ {
		v |= uint64(b[i]&0x7f) << (7 * uint(i))
		if b[i] < 0x80 {
			return v, i + 1, nil
		}
	}
	return 0, 0, errors.New("bad varint")
}

func fields(b []byte) ([]field, error) {
	var out []field
	for len(b) > 0 {
		key, n, err := readVarint(b)
		if err != nil {
			return nil, err
		}
		b = b[n:]
		f := field{num: int(key >> 3)}
		switch key & 7 {
		case 0:
			f.varint, n, err = readVarint(b)
			if err != nil {
				return nil, err
			}
			b = b[n:]
		case 2:
			size, n, err := readVarint(b)
			if err != nil || uint64(len(b)-n) < size {
				return nil, errors.New("bad length")
			}
			f.bytes = b[n : n+int(size)]
			b = b[n+int(size):]
		default:
			return nil, fmt.Errorf("unexpected wire type %d", key&7)
		}
		out = append(out, f)
	}
	return out, nil
}

// messages parses each occurrence of the message field `num` of `b`.
func messages(b []byte, num int) ([][]field, error) {
	fs, err := fields(b)
	if err != nil {
		return nil, err
	}
	var out [][]field
	for _, f := range fs {
		if f.num != num {
			continue
		}
		sub, err := fields(f.bytes)
		if err != nil {
			return nil, err
		}
		out = append(out, sub)
	}
	return out, nil
}

func appendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

func appendBytes(b []byte, num int, data []byte) []byte {
	b = appendVarint(b, uint64(num)<<3|2)
	b = appendVarint(b, uint64(len(data)))
	return append(b, data...)
}

type options struct {
	PreStartRequired           bool `json:"pre_start_required"`
	PreferredAllocationOffered bool `json:"get_preferred_allocation_available"`
}

func decodeOptions(b []byte) (options, error) {
	fs, err := fields(b)
	var o options
	for _, f := range fs {
		switch f.num {
		case 1:
			o.PreStartRequired = f.varint != 0
		case 2:
			o.PreferredAllocationOffered = f.varint != 0
		}
	}
	return o, err
}

type registerRequest struct {
	version, endpoint, resource string
	options                     options
}

func decodeRegister(b []byte) (registerRequest, error) {
	fs, err := fields(b)
	var r registerRequest
	for _, f := range fs {
		switch f.num {
		case 1:
			r.version = string(f.bytes)
		case 2:
			r.endpoint = string(f.bytes)
		case 3:
			r.resource = string(f.bytes)
		case 4:
			if r.options, err = decodeOptions(f.bytes); err != nil {
				return r, err
			}
		}
	}
	return r, err
}

type device struct {
	ID     string  `json:"id"`
	Health string  `json:"health"`
	NUMA   []int64 `json:"numa"`
}

func decodeDevices(b []byte) ([]device, error) {
	list, err := messages(b, 1)
	if err != nil {
		return nil, err
	}
	var out []device
	for _, dfs := range list {
		var d device
		for _, df := range dfs {
			switch df.num {
			case 1:
				d.ID = string(df.bytes)
			case 2:
				d.Health = string(df.bytes)
			case 3: // TopologyInfo { repeated NUMANode nodes = 1 { int64 ID = 1 } }
				nodes, err := messages(df.bytes, 1)
				if err != nil {
					return nil, err
				}
				for _, nfs := range nodes {
					var id int64 // node 0 is the empty message
					for _, nf := range nfs {
						if nf.num == 1 {
							id = int64(nf.varint)
						}
					}
					d.NUMA = append(d.NUMA, id)
				}
			}
		}
		out = append(out, d)
	}
	return out, nil
}

func encodeAllocate(ids []string) []byte {
	var container []byte
	for _, id := range ids {
		container = appendBytes(container, 1, []byte(id))
	}
	return appendBytes(nil, 1, container)
}

func encodePreferred(available, mustInclude []string, size int) []byte {
	var container []byte
	for _, id := range available {
		container = appendBytes(container, 1, []byte(id))
	}
	for _, id := range mustInclude {
		container = appendBytes(container, 2, []byte(id))
	}
	container = appendVarint(appendVarint(container, 3<<3), uint64(size))
	return appendBytes(nil, 1, container)
}

func decodePreferred(b []byte) ([][]string, error) {
	containers, err := messages(b, 1)
	if err != nil {
		return nil, err
	}
	var out [][]string
	for _, cfs := range containers {
		ids := []string{}
		for _, cf := range cfs {
			if cf.num == 1 {
				ids = append(ids, string(cf.bytes))
			}
		}
		out = append(out, ids)
	}
	return out, nil
}

type preference struct {
	Available   []string   `json:"available"`
	MustInclude []string   `json:"must_include"`
	Size        int        `json:"size"`
	Answer      [][]string `json:"answer"`
}

type deviceSpec struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

type containerResponse struct {
	Envs    map[string]string `json:"envs"`
	Devices []deviceSpec      `json:"devices"`
	// The fully qualified CDI names of the devices (cdi_devices, field 5).
	CDIDevices []string `json:"cdi_devices,omitempty"`
}

func decodeAllocateResponse(b []byte) ([]containerResponse, error) {
	containers, err := messages(b, 1)
	if err != nil {
		return nil, err
	}
	var out []containerResponse
	for _, cfs := range containers {
		c := containerResponse{Envs: map[string]string{}}
		for _, cf := range cfs {
			sub, err := fields(cf.bytes)
			if err != nil {
				return nil, err
			}
			switch cf.num {
			case 1: // map<string, string> envs: entries { key = 1, value = 2 }
				var k, v string
				for _, e := range sub {
					if e.num == 1 {
						k = string(e.bytes)
					} else if e.num == 2 {
						v = string(e.bytes)
					}
				}
				c.Envs[k] = v
			case 3:
				var s deviceSpec
				for _, e := range sub {
					switch e.num {
					case 1:
						s.ContainerPath = string(e.bytes)
					case 2:
						s.HostPath = string(e.bytes)
					case 3:
						s.Permissions = string(e.bytes)
					}
				}
				c.Devices = append(c.Devices, s)
			case 5: // CDIDevice { string name = 1 }
				for _, e := range sub {
					if e.num == 1 {
						c.CDIDevices = append(c.CDIDevices, string(e.bytes))
					}
				}
			}
		}
		out = append(out, c)
	}
	return out, nil
}

// ---------------------------------------------------------------- the kubelet

const (
	pluginService = "/v1beta1.DevicePlugin/"
	dialTimeout   = 10 * time.Second
)

type endpoint struct {
	resource, socket string
	options          options
	conn             *grpc.ClientConn
	cancel           context.CancelFunc
}

type resource struct {
	Resource      string  `json:"resource"`
	Endpoint      string  `json:"endpoint"`
	Options       options `json:"options"`
	Registrations int     `json:"registrations"`
	// Registers answered without a dial: the client was still held.
	AlreadyConnected int       `json:"already_connected"`
	Lists            int       `json:"lists"`
	Devices          []device  `json:"devices"`
	registeredAt     time.Time // of the latest registration
	listedAt         time.Time // first list of the latest registration
	ep               *endpoint
}

type kubelet struct {
	dir            string
	dialAfterReply bool
	// How long runClient takes to drop a client once its ListAndWatch ended.
	linger  time.Duration
	mu      sync.Mutex
	changed *sync.Cond
	res     map[string]*resource
	server  *grpc.Server
	errors  []string
	// With -stream: told of each registration and device list (stream.go).
	onEvent func(map[string]interface{})
	pods    *pods // pods.go; its own lock
}

func newKubelet(dir string, dialAfterReply bool) *kubelet {
	k := &kubelet{dir: dir, dialAfterReply: dialAfterReply, res: map[string]*resource{}, pods: newPods(dir)}
	k.changed = sync.NewCond(&k.mu)
	return k
}

func (k *kubelet) failf(format string, args ...interface{}) {
	k.mu.Lock()
	k.errors = append(k.errors, fmt.Sprintf(format, args...))
	k.mu.Unlock()
}

func (k *kubelet) start() error {
	k.pods.begin(time.Now()) // its checkpoint read back before kubelet.sock is served
	sock := filepath.Join(k.dir, "kubelet.sock")
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	k.server = grpc.NewServer(grpc.CustomCodec(rawCodec{}))
	k.server.RegisterService(&grpc.ServiceDesc{
		ServiceName: "v1beta1.Registration",
		HandlerType: (*interface{})(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Register",
			Handler: func(_ interface{}, ctx context.Context, dec func(interface{}) error, _ grpc.UnaryServerInterceptor) (interface{}, error) {
				var in []byte
				if err := dec(&in); err != nil {
					return nil, err
				}
				if err := k.register(in); err != nil {
					return nil, err
				}
				return &[]byte{}, nil
			},
		}},
		Streams: []grpc.StreamDesc{},
	}, struct{}{})
	go func() { _ = k.server.Serve(lis) }()
	return nil
}

// stop is the kubelet going away: its server and every plugin connection close.
func (k *kubelet) stop() {
	k.server.Stop()
	k.pods.stop()
	k.mu.Lock()
	var eps []*endpoint
	for _, r := range k.res {
		if r.ep != nil {
			eps = append(eps, r.ep)
			r.ep = nil
		}
	}
	k.mu.Unlock()
	for _, ep := range eps {
		ep.cancel()
		ep.conn.Close()
	}
}

func (k *kubelet) register(in []byte) error {
	req, err := decodeRegister(in)
	if err != nil {
		return fmt.Errorf("malformed RegisterRequest: %v", err)
	}
	if req.version != "v1beta1" {
		return fmt.Errorf("requested device plugin version %q is not supported", req.version)
	}
	if !k.dialAfterReply {
		// connectClient (1.26 and later): a client still held for the name
		// answers a Register for the same socket without a dial, and
		// refuses one for another socket.
		k.mu.Lock()
		var held *endpoint
		if r := k.res[req.resource]; r != nil && r.ep != nil {
			held = r.ep
			if held.socket == req.endpoint {
				r.AlreadyConnected++
			}
		}
		k.mu.Unlock()
		if held != nil && held.socket != req.endpoint {
			return fmt.Errorf("the device plugin %s already registered with a different socket path %s",
				req.resource, filepath.Join(k.dir, held.socket))
		}
		if held != nil {
			return nil
		}
	}
	if k.dialAfterReply {
		// Old kubelets: `go m.addEndpoint(r)`, with the options of the request.
		go func() {
			if err := k.connect(req); err != nil {
				k.failf("%s: %v", req.resource, err)
			}
		}()
		return nil
	}
	return k.connect(req)
}

func (k *kubelet) connect(req registerRequest) error {
	socket := filepath.Join(k.dir, req.endpoint)
	ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
	defer cancel()
	// As the kubelet's devicemanager client dials its plugins.
	conn, err := grpc.DialContext(ctx, socket,
		grpc.WithInsecure(),
		grpc.WithBlock(),
		grpc.WithAuthority("localhost"),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	)
	if err != nil {
		return fmt.Errorf("failed to dial device plugin: %v", err)
	}
	opts := req.options
	if !k.dialAfterReply {
		if opts, err = k.options(ctx, conn); err != nil {
			conn.Close()
			return err
		}
	}
	watchCtx, stopWatch := context.WithCancel(context.Background())
	ep := &endpoint{resource: req.resource, socket: req.endpoint, options: opts, conn: conn, cancel: stopWatch}
	k.mu.Lock()
	r := k.res[req.resource]
	if r == nil {
		r = &resource{Resource: req.resource}
		k.res[req.resource] = r
	}
	old := r.ep
	r.ep, r.Endpoint, r.Options = ep, req.endpoint, opts
	r.Registrations++
	r.registeredAt, r.listedAt = time.Now(), time.Time{}
	k.changed.Broadcast()
	if k.onEvent != nil {
		k.onEvent(map[string]interface{}{"event": "registered", "resource": req.resource})
	}
	k.mu.Unlock()
	if old != nil {
		old.cancel()
		old.conn.Close()
	}
	go k.watch(watchCtx, r, ep)
	return nil
}

func (k *kubelet) options(ctx context.Context, conn *grpc.ClientConn) (options, error) {
	var reply []byte
	if err := conn.Invoke(ctx, pluginService+"GetDevicePluginOptions", &[]byte{}, &reply); err != nil {
		return options{}, fmt.Errorf("failed to get device plugin options: %v", err)
	}
	opts, err := decodeOptions(reply)
	if err != nil {
		return opts, fmt.Errorf("malformed DevicePluginOptions: %v", err)
	}
	return opts, nil
}

func (k *kubelet) watch(ctx context.Context, r *resource, ep *endpoint) {
	desc := &grpc.StreamDesc{StreamName: "ListAndWatch", ServerStreams: true}
	stream, err := ep.conn.NewStream(ctx, desc, pluginService+"ListAndWatch")
	if err == nil {
		err = stream.SendMsg(&[]byte{})
	}
	if err == nil {
		err = stream.CloseSend()
	}
	for err == nil {
		var msg []byte
		if err = stream.RecvMsg(&msg); err != nil {
			break
		}
		devices, derr := decodeDevices(msg)
		if derr != nil {
			k.failf("%s: malformed ListAndWatchResponse: %v", r.Resource, derr)
			return
		}
		k.mu.Lock()
		current := r.ep == ep
		if current {
			r.Devices = devices
			r.Lists++
			if r.listedAt.IsZero() {
				r.listedAt = time.Now()
			}
			k.changed.Broadcast()
			if k.onEvent != nil {
				k.onEvent(map[string]interface{}{"event": "list", "resource": r.Resource, "devices": devices})
			}
		}
		k.mu.Unlock()
		if current {
			// The device manager writes its checkpoint at every list.
			if werr := k.writeCheckpoint(); werr != nil {
				k.failf("%s: checkpoint: %v", r.Resource, werr)
			}
		}
	}
	if ctx.Err() != nil {
		return // stopped, or replaced by a newer registration
	}
	// runClient: the stream ended, so the client is disconnected and
	// deregistered, `linger` after (the kubelet notices when it notices).
	k.mu.Lock()
	linger := k.linger
	k.mu.Unlock()
	time.Sleep(linger)
	k.mu.Lock()
	if r.ep == ep {
		r.ep = nil
		k.changed.Broadcast()
	}
	k.mu.Unlock()
	ep.conn.Close()
}

// waitListed waits until `expect` resources have a first list from a
// registration made after `since`, and returns when the last of them did.
func (k *kubelet) waitListed(expect int, since time.Time, timeout time.Duration) (time.Time, error) {
	deadline := time.Now().Add(timeout)
	timer := time.AfterFunc(timeout, func() { k.mu.Lock(); k.changed.Broadcast(); k.mu.Unlock() })
	defer timer.Stop()
	k.mu.Lock()
	defer k.mu.Unlock()
	for {
		var last time.Time
		n := 0
		for _, r := range k.res {
			if r.ep != nil && r.registeredAt.After(since) && !r.listedAt.IsZero() {
				n++
				if r.listedAt.After(last) {
					last = r.listedAt
				}
			}
		}
		if n >= expect {
			return last, nil
		}
		if time.Now().After(deadline) {
			return last, fmt.Errorf("%d of %d resources registered and listed after %v", n, expect, timeout)
		}
		k.changed.Wait()
	}
}

func preferred(ep *endpoint, available, mustInclude []string, size int) ([][]string, error) {
	var reply []byte
	request := encodePreferred(available, mustInclude, size)
	err := ep.conn.Invoke(context.Background(), pluginService+"GetPreferredAllocation", request, &reply)
	if err != nil {
		return nil, err
	}
	return decodePreferred(reply)
}

// probeUnknown calls a method no plugin serves; the status grpc-go read.
func probeUnknown(conn *grpc.ClientConn, method string) (string, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var reply []byte
	st := status.Convert(conn.Invoke(ctx, method, &[]byte{}, &reply))
	return st.Code().String(), st.Message()
}

func allocate(ep *endpoint, ids []string) ([]containerResponse, error) {
	var reply []byte
	err := ep.conn.Invoke(context.Background(), pluginService+"Allocate", encodeAllocate(ids), &reply)
	if err != nil {
		return nil, err
	}
	return decodeAllocateResponse(reply)
}

// ---------------------------------------------------------------- scenario

type callError struct {
	Resource string `json:"resource"`
	Code     string `json:"code"`
	Message  string `json:"message"`
}

type report struct {
	RegisteredS   float64                        `json:"registered_s"`
	RegisteredAt  float64                        `json:"registered_at_unix"`
	RestartS      []float64                      `json:"restart_s"`
	Resources     []*resource                    `json:"resources"`
	Samples       map[string][]containerResponse `json:"samples"`
	AllocateMs    []float64                      `json:"allocate_ms"`
	UnknownDevice *callError                     `json:"unknown_device,omitempty"`
	UnknownMethod *callError                     `json:"unknown_method,omitempty"`
	Preferences   map[string]preference          `json:"preferences"`
	Changed       map[string][]device            `json:"changed"`
	BreakS        float64                        `json:"break_s"`
	Errors        []string                       `json:"errors"`
	// The -admit / -admit-after scenario (pods.go).
	Pods             map[string]podReport `json:"pods,omitempty"`
	AdmitErrors      []string             `json:"admit_errors,omitempty"`
	SyncedS          float64              `json:"synced_s,omitempty"`
	CheckpointWrites int                  `json:"checkpoint_writes,omitempty"`
}

func main() {
	dir := flag.String("dir", "", "device-plugin directory (kubelet.sock is served here)")
	expect := flag.Int("expect", 1, "resources to wait for")
	timeout := flag.Duration("timeout", 30*time.Second, "per wait")
	allocs := flag.Int("allocs", 0, "Allocate calls to time, round-robin over the resources")
	restarts := flag.Int("restarts", 0, "kubelet restarts to make after the calls")
	awaitChange := flag.Duration("await-change", 0, "after the samples, print awaiting-change on stderr and wait this long for a device list to change")
	dial := flag.String("dial", "sync", "sync: dial and ask the options inside Register (kubelet >= 1.25); after-reply: reply, then dial (older kubelets)")
	podResources := flag.String("pod-resources", "", "also serve the PodResources List API on this socket")
	podResourcesOnly := flag.Bool("pod-resources-only", false, "serve only the PodResources API, until killed")
	breakConn := flag.Bool("break", false, "after the calls, close the first resource's connection as a transport failure would, and time its return")
	linger := flag.Duration("linger", 0, "how long a client whose stream ended is still held (a Register meanwhile is answered without a dial)")
	flag.Parse()
	if *draRegistry != "" {
		os.Exit(runDRA(*timeout)) // dra.go
	}
	if *podResourcesOnly {
		only := newPods("")
		only.prPath = *podResources
		only.begin(time.Now())
		select {}
	}
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "gokubelet: -dir is required")
		os.Exit(2)
	}
	if *dial != "sync" && *dial != "after-reply" {
		fmt.Fprintln(os.Stderr, "gokubelet: -dial is sync or after-reply")
		os.Exit(2)
	}
	k := newKubelet(*dir, *dial == "after-reply")
	k.linger = *linger
	k.pods.prPath = *podResources
	if *stream {
		os.Exit(runStream(k)) // stream.go
	}
	start := time.Now()
	if err := k.start(); err != nil {
		fmt.Fprintln(os.Stderr, "gokubelet:", err)
		os.Exit(1)
	}
	rep := report{
		Samples:     map[string][]containerResponse{},
		Preferences: map[string]preference{},
		Changed:     map[string][]device{},
		RestartS:    []float64{},
		AllocateMs:  []float64{},
	}
	fail := func(err error) {
		rep.Errors = append(rep.Errors, err.Error())
		k.mu.Lock()
		rep.Errors = append(rep.Errors, k.errors...)
		k.mu.Unlock()
		_ = json.NewEncoder(os.Stdout).Encode(rep)
		os.Exit(1)
	}
	last, err := k.waitListed(*expect, start, *timeout)
	if err != nil {
		fail(err)
	}
	rep.RegisteredS = last.Sub(start).Seconds()
	rep.RegisteredAt = float64(last.UnixNano()) / 1e9
	if *admitFirst != "" || *admitAfter != "" {
		runPods(k, &rep, start)
		k.mu.Lock()
		for _, r := range k.res {
			rep.Resources = append(rep.Resources, r)
		}
		rep.Errors = append(rep.Errors, k.errors...)
		k.mu.Unlock()
		if rep.Errors == nil {
			rep.Errors = []string{}
		}
		_ = json.NewEncoder(os.Stdout).Encode(rep)
		k.stop()
		return
	}

	// What the scenario calls: each resource's endpoint and device list now.
	type target struct {
		ep      *endpoint
		devices []device
	}
	targets := map[string]target{}
	var names []string
	k.mu.Lock()
	for name, r := range k.res {
		names = append(names, name)
		targets[name] = target{r.ep, append([]device(nil), r.Devices...)}
	}
	k.mu.Unlock()
	sort.Strings(names)

	// Where the plugin offers it, a preference for two of the healthy
	// devices that must include the last of them.
	for _, name := range names {
		t := targets[name]
		if !t.ep.options.PreferredAllocationOffered {
			continue
		}
		var healthy []string
		for _, d := range t.devices {
			if d.Health == "Healthy" {
				healthy = append(healthy, d.ID)
			}
		}
		if len(healthy) < 2 {
			continue
		}
		must := healthy[len(healthy)-1:]
		answer, err := preferred(t.ep, healthy, must, 2)
		if err != nil {
			fail(fmt.Errorf("%s: GetPreferredAllocation: %v", name, err))
		}
		rep.Preferences[name] = preference{healthy, must, 2, answer}
	}

	// One sample Allocate per resource: its first healthy device.
	for _, name := range names {
		for _, d := range targets[name].devices {
			if d.Health == "Healthy" {
				resp, err := allocate(targets[name].ep, []string{d.ID})
				if err != nil {
					fail(fmt.Errorf("%s: Allocate(%s): %v", name, d.ID, err))
				}
				rep.Samples[name] = resp
				break
			}
		}
	}
	// An ID the plugin never advertised: the call fails, the plugin keeps serving.
	if len(names) > 0 {
		_, err := allocate(targets[names[0]].ep, []string{"no-such-device-" + strings.Repeat("x", 64)})
		if err == nil {
			fail(fmt.Errorf("%s: Allocate of an unknown ID succeeded", names[0]))
		}
		st := status.Convert(err)
		rep.UnknownDevice = &callError{Resource: names[0], Code: st.Code().String(), Message: st.Message()}
		// A method the plugin does not serve: grpc-go must read a status from
		// the answer (a Trailers-Only response without content-type is INTERNAL).
		rep.UnknownMethod = &callError{Resource: names[0]}
		rep.UnknownMethod.Code, rep.UnknownMethod.Message = probeUnknown(targets[names[0]].ep.conn, pluginService+"NoSuchMethod")
	}
	if *awaitChange > 0 {
		// Tell whoever runs us (on stderr) that the lists are known, then
		// report every resource whose list the plugin sends again.
		// First let the updates the samples caused (held IOMMU groups) arrive.
		snapshot := func() map[string]int {
			k.mu.Lock()
			defer k.mu.Unlock()
			lists := map[string]int{}
			for name, r := range k.res {
				lists[name] = r.Lists
			}
			return lists
		}
		lists := snapshot()
		for {
			time.Sleep(200 * time.Millisecond)
			again := snapshot()
			if fmt.Sprint(again) == fmt.Sprint(lists) {
				break
			}
			lists = again
		}
		fmt.Fprintln(os.Stderr, "awaiting-change")
		deadline := time.Now().Add(*awaitChange)
		settled := time.Time{}
		for time.Now().Before(deadline) && (settled.IsZero() || time.Now().Before(settled)) {
			time.Sleep(5 * time.Millisecond)
			k.mu.Lock()
			for name, r := range k.res {
				if r.Lists != lists[name] {
					rep.Changed[name] = append([]device(nil), r.Devices...)
				}
			}
			k.mu.Unlock()
			if len(rep.Changed) > 0 && settled.IsZero() {
				settled = time.Now().Add(500 * time.Millisecond) // for changes that should not come
			}
		}
	}
	for i := 0; i < *allocs; i++ {
		name := names[i%len(names)]
		t := targets[name]
		d := t.devices[(i/len(names))%len(t.devices)]
		t0 := time.Now()
		resp, err := allocate(t.ep, []string{d.ID})
		rep.AllocateMs = append(rep.AllocateMs, float64(time.Since(t0).Nanoseconds())/1e6)
		if err != nil || len(resp) != 1 {
			fail(fmt.Errorf("%s: Allocate(%s): %v (%d responses)", name, d.ID, err, len(resp)))
		}
	}
	if *breakConn && len(names) > 0 {
		k.mu.Lock()
		ep := k.res[names[0]].ep
		k.mu.Unlock()
		broken := time.Now()
		ep.conn.Close()
		wake := time.AfterFunc(*timeout, func() { k.mu.Lock(); k.changed.Broadcast(); k.mu.Unlock() })
		k.mu.Lock()
		for {
			r := k.res[names[0]]
			if r.ep != nil && r.ep != ep && !r.listedAt.IsZero() {
				rep.BreakS = r.listedAt.Sub(broken).Seconds()
				break
			}
			if time.Since(broken) > *timeout {
				k.mu.Unlock()
				fail(fmt.Errorf("%s: not listed again within %v of its connection closing", names[0], *timeout))
			}
			k.changed.Wait()
		}
		k.mu.Unlock()
		wake.Stop()
	}
	for i := 0; i < *restarts; i++ {
		// A kubelet restart: everything closes and every socket in the
		// directory is deleted (CleanupPluginDirectory: sockets only, and never
		// the checkpoint); the new kubelet serves kubelet.sock again.
		k.stop()
		entries, _ := os.ReadDir(*dir)
		for _, e := range entries {
			if e.Type()&os.ModeSocket != 0 && e.Name() != checkpointFile {
				_ = os.Remove(filepath.Join(*dir, e.Name()))
			}
		}
		restarted := time.Now()
		if err := k.start(); err != nil {
			fail(err)
		}
		last, err := k.waitListed(len(names), restarted, *timeout)
		if err != nil {
			fail(fmt.Errorf("restart %d: %v", i+1, err))
		}
		rep.RestartS = append(rep.RestartS, last.Sub(restarted).Seconds())
	}

	k.mu.Lock()
	for _, name := range names {
		rep.Resources = append(rep.Resources, k.res[name])
	}
	rep.Errors = append(rep.Errors, k.errors...)
	k.mu.Unlock()
	if rep.Errors == nil {
		rep.Errors = []string{}
	}
	_ = json.NewEncoder(os.Stdout).Encode(rep)
	k.stop()
}
