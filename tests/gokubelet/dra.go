// The DRA side of gokubelet (-dra-registry): the kubelet's plugin watcher and
// DRA plugin client on grpc-go, messages encoded by hand like the rest.
//
// It polls the registry directory for sockets (the kubelet uses inotify, and
// takes any socket whose name does not start with "."), dials each one
// (blocking, 10 s), calls GetInfo (1 s), checks the type is DRAPlugin, takes
// the first of the plugin's supported versions it knows ("v1.DRAPlugin",
// "v1beta1.DRAPlugin", or only those -dra-services lists) and calls
// NotifyRegistrationStatus (5 s); before that it connects and opens the
// plugin's health stream (drahealth.go). Then it prepares the -dra-claims on
// the chosen service with the kubelet's 45 s deadline, asking again for
// claims a reply left out, follows the first claim's health through
// -dra-health-expect if given, and unprepares them; each restart forgets every
// plugin, registers again from the sockets and prepares the claims again. It
// also calls a method no DRA plugin serves on both sockets, to see the status
// grpc-go reads. One JSON report on stdout.
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
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
)

var (
	draRegistry = flag.String("dra-registry", "", "run as the kubelet's DRA side, watching this plugins_registry directory")
	draClaims   = flag.String("dra-claims", "", "claims to prepare, then unprepare: namespace/name/uid, comma separated")
	draRestarts = flag.Int("dra-restarts", 0, "kubelet restarts after unprepare, each followed by a prepare")
	draServices = flag.String("dra-services", "v1.DRAPlugin,v1beta1.DRAPlugin", "services this kubelet supports, newest first")
)

const draCallTimeout = 45 * time.Second

var draPackages = map[string]string{
	"v1.DRAPlugin":      "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
	"v1beta1.DRAPlugin": "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
}

type draPlugin struct {
	Name     string   `json:"name"`
	Endpoint string   `json:"endpoint"`
	Service  string   `json:"service"`
	Versions []string `json:"versions"`
	Socket   string   `json:"socket"`
	// The health service asked for (pickHealthService), "" for none.
	HealthService string `json:"health_service"`
	conn          *grpc.ClientConn
	cancel        context.CancelFunc // its health stream's
}

type draDevice struct {
	RequestNames []string `json:"request_names"`
	Pool         string   `json:"pool_name"`
	Device       string   `json:"device_name"`
	CDIDeviceIDs []string `json:"cdi_device_ids"`
}

type draPrepared struct {
	Devices []draDevice `json:"devices"`
	Error   string      `json:"error"`
}

type draReport struct {
	Plugins       []*draPlugin             `json:"plugins"`
	Registrations int                      `json:"registrations"`
	Rejected      []string                 `json:"rejected"`
	Prepare       map[string]draPrepared   `json:"prepare"`
	PrepareMs     float64                  `json:"prepare_ms"`
	Unprepare     map[string]string        `json:"unprepare"`
	AfterRestart  []map[string]draPrepared `json:"after_restart"`
	// Method no DRA plugin serves, by socket ("registration", "dra"): "Code: message".
	UnknownMethods map[string]string `json:"unknown_methods"`
	HealthOpened   int               `json:"health_opened"`    // health streams asked for
	HealthOpenedMs []float64         `json:"health_opened_ms"` // when each was, since the start
	HealthErrors   []string          `json:"health_errors"`    // how each one ended
	HealthSeen     []healthSeen      `json:"health_seen"`      // the first claim's, with -dra-health-expect
	Errors         []string          `json:"errors"`
}

type draKubelet struct {
	dir      string
	services []string
	mu       sync.Mutex
	changed  *sync.Cond
	plugins  map[string]*draPlugin
	seen     map[string]os.FileInfo
	health   map[string]healthCache // by driver
	rep      *draReport
	begun    time.Time
	stop     chan struct{}
	done     chan struct{}
	streams  sync.WaitGroup // health streams
}

type draClaim struct{ namespace, name, uid string }

func runDRA(timeout time.Duration) int {
	rep := &draReport{Prepare: map[string]draPrepared{}, Unprepare: map[string]string{}, AfterRestart: []map[string]draPrepared{}, Rejected: []string{}, Errors: []string{}, UnknownMethods: map[string]string{}, HealthErrors: []string{}, HealthSeen: []healthSeen{}, HealthOpenedMs: []float64{}}
	if _, ok := healthServices[*draRelease]; !ok {
		fmt.Fprintf(os.Stderr, "gokubelet: -dra-release %q is not 1.36 or 1.37\n", *draRelease)
		return 2
	}
	var claims []draClaim
	for _, c := range strings.Split(*draClaims, ",") {
		if c == "" {
			continue
		}
		parts := strings.Split(c, "/")
		if len(parts) != 3 {
			fmt.Fprintf(os.Stderr, "gokubelet: -dra-claims entry %q is not namespace/name/uid\n", c)
			return 2
		}
		claims = append(claims, draClaim{parts[0], parts[1], parts[2]})
	}
	k := &draKubelet{dir: *draRegistry, services: strings.Split(*draServices, ","), rep: rep, begun: time.Now()}
	k.changed = sync.NewCond(&k.mu)
	finish := func(err error) int {
		k.halt()
		if err != nil {
			rep.Errors = append(rep.Errors, err.Error())
		}
		_ = json.NewEncoder(os.Stdout).Encode(rep)
		if len(rep.Errors) > 0 {
			return 1
		}
		return 0
	}
	// The kubelet makes its plugins directory beside the registry at start
	// (setupDataDirs); a plugin makes only its own directory in it.
	if err := os.MkdirAll(filepath.Join(filepath.Dir(k.dir), "plugins"), 0o750); err != nil {
		return finish(err)
	}
	if err := os.MkdirAll(k.dir, 0o755); err != nil {
		return finish(err)
	}
	k.begin()
	plugin, err := k.waitPlugin(timeout)
	if err != nil {
		return finish(err)
	}
	start := time.Now()
	if rep.Prepare, err = k.prepare(plugin, claims); err != nil {
		return finish(err)
	}
	rep.PrepareMs = float64(time.Since(start).Microseconds()) / 1000
	if *draHealthExpect != "" && len(claims) > 0 {
		first := claims[0].uid
		if err := k.awaitHealth(plugin, first, rep.Prepare[first], strings.Split(*draHealthExpect, ","), timeout); err != nil {
			return finish(err)
		}
	}
	if *draHealthOpens > 0 {
		if err := k.awaitOpens(*draHealthOpens, timeout); err != nil {
			return finish(err)
		}
	}
	if rep.Unprepare, err = k.unprepare(plugin, claims); err != nil {
		return finish(err)
	}
	for i := 0; i < *draRestarts; i++ {
		k.halt()
		k.begin()
		if plugin, err = k.waitPlugin(timeout); err != nil {
			return finish(err)
		}
		again, err := k.prepare(plugin, claims)
		if err != nil {
			return finish(err)
		}
		rep.AfterRestart = append(rep.AfterRestart, again)
	}
	k.mu.Lock()
	for _, p := range k.plugins {
		rep.Plugins = append(rep.Plugins, p)
	}
	k.mu.Unlock()
	return finish(nil)
}

func (k *draKubelet) begin() {
	k.mu.Lock()
	k.plugins = map[string]*draPlugin{}
	k.seen = map[string]os.FileInfo{}
	k.health = map[string]healthCache{}
	k.mu.Unlock()
	k.stop, k.done = make(chan struct{}), make(chan struct{})
	go k.watch()
}

// halt stops the watcher and forgets every plugin, as a kubelet restart does.
func (k *draKubelet) halt() {
	if k.stop == nil {
		return
	}
	close(k.stop)
	<-k.done
	k.stop = nil
	k.mu.Lock()
	for _, p := range k.plugins {
		p.cancel()
		p.conn.Close()
	}
	k.mu.Unlock()
	k.streams.Wait()
}

func (k *draKubelet) watch() {
	defer close(k.done)
	for {
		entries, _ := os.ReadDir(k.dir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), ".") {
				continue
			}
			path := filepath.Join(k.dir, e.Name())
			info, err := os.Lstat(path)
			if err != nil || info.Mode()&os.ModeSocket == 0 {
				continue
			}
			if old, ok := k.seen[path]; ok && os.SameFile(old, info) && old.ModTime().Equal(info.ModTime()) {
				continue
			}
			k.seen[path] = info
			k.register(path)
		}
		select {
		case <-k.stop:
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func draDial(ctx context.Context, path string, block bool) (*grpc.ClientConn, error) {
	opts := []grpc.DialOption{
		grpc.WithInsecure(),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	}
	if block {
		opts = append(opts, grpc.WithBlock())
	}
	return grpc.DialContext(ctx, path, opts...)
}

func (k *draKubelet) register(path string) {
	fail := func(format string, args ...interface{}) {
		k.mu.Lock()
		k.rep.Errors = append(k.rep.Errors, fmt.Sprintf(format, args...))
		k.mu.Unlock()
	}
	ctx, cancel := context.WithTimeout(context.Background(), dialTimeout)
	defer cancel()
	conn, err := draDial(ctx, path, true)
	if err != nil {
		fail("RegisterPlugin error -- dial failed at socket %s, err: %v", path, err)
		return
	}
	defer conn.Close()
	infoCtx, infoCancel := context.WithTimeout(context.Background(), time.Second)
	defer infoCancel()
	var reply []byte
	if err := conn.Invoke(infoCtx, "/pluginregistration.Registration/GetInfo", &[]byte{}, &reply); err != nil {
		fail("RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket %s, err: %v", path, err)
		return
	}
	fs, err := fields(reply)
	if err != nil {
		fail("malformed PluginInfo from %s: %v", path, err)
		return
	}
	p := &draPlugin{Socket: path, Versions: []string{}}
	var kind string
	for _, f := range fs {
		switch f.num {
		case 1:
			kind = string(f.bytes)
		case 2:
			p.Name = string(f.bytes)
		case 3:
			p.Endpoint = string(f.bytes)
		case 4:
			p.Versions = append(p.Versions, string(f.bytes))
		}
	}
	if p.Endpoint == "" {
		p.Endpoint = path
	}
	problem := ""
	if kind != "DRAPlugin" {
		problem = fmt.Sprintf("RegisterPlugin error -- no handler registered for plugin type: %s at socket %s", kind, path)
	} else {
	choose:
		for _, v := range p.Versions {
			for _, s := range k.services {
				if v == s {
					p.Service = v
					break choose
				}
			}
		}
		if p.Service == "" {
			problem = fmt.Sprintf("RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC services of DRA driver plugin %s at endpoint %s: none of services supported by the plugin (%q) are supported by the kubelet (%q)", p.Name, p.Endpoint, p.Versions, k.services)
		}
	}
	if problem == "" {
		if p.conn, err = draDial(context.Background(), p.Endpoint, false); err != nil {
			problem = fmt.Sprintf("RegisterPlugin error -- plugin registration failed with err: %v", err)
		}
	}
	if problem == "" {
		// As pm.add: the health stream starts before the plugin is told.
		var ctx context.Context
		ctx, p.cancel = context.WithCancel(context.Background())
		p.HealthService = pickHealthService(*draRelease, p.Versions)
		if p.HealthService != "" {
			k.streams.Add(1)
			go func() {
				defer k.streams.Done()
				k.watchHealth(ctx, p)
			}()
		}
		code, message := probeUnknown(conn, "/pluginregistration.Registration/NoSuchMethod")
		unknownReg := code + ": " + message
		code, message = probeUnknown(p.conn, "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NoSuchMethod")
		k.mu.Lock()
		k.rep.UnknownMethods["registration"] = unknownReg
		k.rep.UnknownMethods["dra"] = code + ": " + message
		k.mu.Unlock()
	}
	notice := appendVarint(nil, 1<<3)
	if problem == "" {
		notice = appendVarint(notice, 1)
	} else {
		notice = appendVarint(notice, 0)
		notice = appendBytes(notice, 2, []byte(problem))
	}
	notifyCtx, notifyCancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer notifyCancel()
	if err := conn.Invoke(notifyCtx, "/pluginregistration.Registration/NotifyRegistrationStatus", notice, &reply); err != nil {
		fail("RegisterPlugin error -- failed to send registration status at socket %s, err: %v", path, err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if problem != "" {
		k.rep.Rejected = append(k.rep.Rejected, problem)
		return
	}
	if old := k.plugins[p.Name]; old != nil {
		old.cancel()
		old.conn.Close()
	}
	k.plugins[p.Name] = p
	k.rep.Registrations++
	k.changed.Broadcast()
}

func (k *draKubelet) waitPlugin(timeout time.Duration) (*draPlugin, error) {
	deadline := time.Now().Add(timeout)
	for {
		k.mu.Lock()
		for _, p := range k.plugins {
			k.mu.Unlock()
			return p, nil
		}
		k.mu.Unlock()
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no DRA plugin registered within %v", timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func encodeClaims(claims []draClaim) []byte {
	var out []byte
	for _, c := range claims {
		var m []byte
		m = appendBytes(m, 1, []byte(c.namespace))
		m = appendBytes(m, 2, []byte(c.uid))
		m = appendBytes(m, 3, []byte(c.name))
		out = appendBytes(out, 1, m)
	}
	return out
}

// draCall calls method for claims, asking again (twice at most) for those a
// reply left out; it returns each claim's map entry value by UID.
func draCall(p *draPlugin, method string, claims []draClaim) (map[string][]byte, error) {
	got := map[string][]byte{}
	pending := claims
	for attempt := 0; attempt < 3 && len(pending) > 0; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), draCallTimeout)
		var reply []byte
		err := p.conn.Invoke(ctx, "/"+draPackages[p.Service]+"/"+method, encodeClaims(pending), &reply)
		cancel()
		if err != nil {
			s, _ := status.FromError(err)
			return nil, fmt.Errorf("%s: %s: %s", method, s.Code(), s.Message())
		}
		entries, err := messages(reply, 1)
		if err != nil {
			return nil, fmt.Errorf("malformed %s response: %v", method, err)
		}
		for _, e := range entries {
			var key string
			var value []byte
			for _, f := range e {
				if f.num == 1 {
					key = string(f.bytes)
				} else if f.num == 2 {
					value = f.bytes
				}
			}
			got[key] = value
		}
		var left []draClaim
		for _, c := range pending {
			if _, ok := got[c.uid]; !ok {
				left = append(left, c)
			}
		}
		pending = left
	}
	if len(pending) > 0 {
		return nil, errors.New(method + " left out claims after 2 retries")
	}
	return got, nil
}

func (k *draKubelet) prepare(p *draPlugin, claims []draClaim) (map[string]draPrepared, error) {
	got, err := draCall(p, "NodePrepareResources", claims)
	if err != nil {
		return nil, err
	}
	out := map[string]draPrepared{}
	for uid, value := range got {
		fs, err := fields(value)
		if err != nil {
			return nil, err
		}
		r := draPrepared{Devices: []draDevice{}}
		for _, f := range fs {
			if f.num == 2 {
				r.Error = string(f.bytes)
				continue
			}
			dfs, err := fields(f.bytes)
			if err != nil {
				return nil, err
			}
			d := draDevice{RequestNames: []string{}, CDIDeviceIDs: []string{}}
			for _, df := range dfs {
				switch df.num {
				case 1:
					d.RequestNames = append(d.RequestNames, string(df.bytes))
				case 2:
					d.Pool = string(df.bytes)
				case 3:
					d.Device = string(df.bytes)
				case 4:
					d.CDIDeviceIDs = append(d.CDIDeviceIDs, string(df.bytes))
				}
			}
			r.Devices = append(r.Devices, d)
		}
		out[uid] = r
	}
	return out, nil
}

func (k *draKubelet) unprepare(p *draPlugin, claims []draClaim) (map[string]string, error) {
	got, err := draCall(p, "NodeUnprepareResources", claims)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for uid, value := range got {
		fs, err := fields(value)
		if err != nil {
			return nil, err
		}
		out[uid] = ""
		for _, f := range fs {
			if f.num == 1 {
				out[uid] = string(f.bytes)
			}
		}
	}
	return out, nil
}
