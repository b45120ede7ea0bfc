// The DRA health stream as the 1.36 kubelet keeps it (pkg/kubelet/cm/dra:
// dra_plugin_manager.go, manager.go's HandleWatchResourcesStream,
// healthinfo.go), on grpc-go, and as the 1.37 one asks for it
// (kubernetes/kubernetes#139477, pickHealthService).
//
// A 1.36 kubelet (-dra-release 1.36) asks every registered plugin for
// /v1alpha1.DRAResourceHealth/NodeWatchResources, advertised or not; a 1.37
// one asks for /v1.DRAResourceHealth/NodeWatchResources if the plugin
// advertised "v1.DRAResourceHealth", else for v1alpha1 if it advertised
// that, else for nothing. Either asks on the plugin's connection, and again
// -dra-health-retry (5 s) after the stream ends for any reason, until it is
// deregistered. Each
// message is the plugin's whole list: per pool/device its health, its time
// (last_updated_time, Unix seconds) and its timeout
// (health_check_timeout_seconds, else 30 s). A device not heard of for longer
// than its timeout reads Unknown; when a stream ends the driver's entries are
// forgotten. A claim's health is what the kubelet writes into the pod's
// allocatedResourcesStatus: per device, its first CDI ID and that health.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
)

var (
	draHealthRetry  = flag.Duration("dra-health-retry", 5*time.Second, "how long after a health stream ends the kubelet asks for it again")
	draHealthExpect = flag.String("dra-health-expect", "", "after preparing, wait until the first claim's devices read each of these in turn (e.g. Healthy,Unhealthy,Healthy), printing `health <uid> <state>` on stderr at each change, then unprepare")
	draHealthOpens  = flag.Int("dra-health-opens", 0, "before unpreparing, wait until this many health streams were asked for")
	draRelease      = flag.String("dra-release", "1.36", "the kubelet release whose choice of health service to make: 1.36 or 1.37")
)

const healthTimeout = 30 * time.Second

// healthServices is what a kubelet of each release reads, newest first.
var healthServices = map[string][]string{
	"1.36": {"v1alpha1.DRAResourceHealth"},
	"1.37": {"v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"},
}

// pickHealthService is the health service a kubelet of release asks a plugin
// that advertised advertised for, or "" for none.
func pickHealthService(release string, advertised []string) string {
	readable := healthServices[release]
	if release == "1.36" {
		return readable[0]
	}
	for _, service := range readable {
		for _, a := range advertised {
			if a == service {
				return service
			}
		}
	}
	return ""
}

var healthNames = map[uint64]string{0: "Unknown", 1: "Healthy", 2: "Unhealthy"}

type healthEntry struct {
	health  string
	updated time.Time
	timeout time.Duration
}

type healthSeen struct {
	Health string  `json:"health"`
	AtMs   float64 `json:"at_ms"` // since the claims were prepared
}

// healthCache is the kubelet's healthInfoCache for one driver; draKubelet.mu guards it.
type healthCache map[string]healthEntry // "pool/device" ->

func (c healthCache) update(msg []byte, now time.Time) error {
	devices, err := messages(msg, 1)
	if err != nil {
		return err
	}
	reported := map[string]bool{}
	for _, d := range devices {
		var pool, name string
		e := healthEntry{health: "Unknown", timeout: healthTimeout}
		for _, f := range d {
			switch f.num {
			case 1:
				id, err := fields(f.bytes)
				if err != nil {
					return err
				}
				for _, g := range id {
					if g.num == 1 {
						pool = string(g.bytes)
					} else if g.num == 2 {
						name = string(g.bytes)
					}
				}
			case 2:
				e.health = healthNames[f.varint]
			case 3:
				e.updated = time.Unix(int64(f.varint), 0)
			case 4:
				if int64(f.varint) > 0 {
					e.timeout = time.Duration(f.varint) * time.Second
				}
			}
		}
		key := pool + "/" + name
		reported[key] = true
		c[key] = e
	}
	for key, e := range c {
		if !reported[key] && e.health != "Unknown" && now.Sub(e.updated) > e.timeout {
			c[key] = healthEntry{health: "Unknown", updated: now, timeout: e.timeout}
		}
	}
	return nil
}

func (c healthCache) get(pool, device string, now time.Time) string {
	e, ok := c[pool+"/"+device]
	if !ok || now.Sub(e.updated) > e.timeout {
		return "Unknown"
	}
	return e.health
}

// watchHealth keeps p's health stream open until ctx ends.
func (k *draKubelet) watchHealth(ctx context.Context, p *draPlugin) {
	for {
		k.mu.Lock()
		k.rep.HealthOpened++
		k.rep.HealthOpenedMs = append(k.rep.HealthOpenedMs, float64(time.Since(k.begun).Microseconds())/1000)
		k.mu.Unlock()
		err := k.healthStream(ctx, p)
		k.mu.Lock()
		delete(k.health, p.Name)
		if ctx.Err() == nil {
			if err == nil {
				err = io.EOF
			}
			// The kubelet logs "Error receiving from WatchResources stream".
			k.rep.HealthErrors = append(k.rep.HealthErrors, err.Error())
		}
		k.mu.Unlock()
		select {
		case <-ctx.Done():
			return
		case <-time.After(*draHealthRetry):
		}
	}
}

func (k *draKubelet) healthStream(ctx context.Context, p *draPlugin) error {
	stream, err := p.conn.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, "/"+p.HealthService+"/NodeWatchResources")
	if err != nil {
		return err
	}
	if err := stream.SendMsg(&[]byte{}); err != nil {
		return err
	}
	if err := stream.CloseSend(); err != nil {
		return err
	}
	for {
		var msg []byte
		if err := stream.RecvMsg(&msg); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		k.mu.Lock()
		cache := k.health[p.Name]
		if cache == nil {
			cache = healthCache{}
			k.health[p.Name] = cache
		}
		err := cache.update(msg, time.Now())
		k.mu.Unlock()
		if err != nil {
			return fmt.Errorf("malformed NodeWatchResourcesResponse: %v", err)
		}
	}
}

// awaitOpens waits until n health streams were asked for.
func (k *draKubelet) awaitOpens(n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		k.mu.Lock()
		opened := k.rep.HealthOpened
		k.mu.Unlock()
		if opened >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d health streams asked for in %v, not %d", opened, timeout, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// claimHealth is the claim's devices' health as one word: the common one, or each joined.
func (k *draKubelet) claimHealth(driver string, prepared draPrepared) string {
	k.mu.Lock()
	defer k.mu.Unlock()
	now := time.Now()
	var states []string
	for _, d := range prepared.Devices {
		states = append(states, k.health[driver].get(d.Pool, d.Device, now))
	}
	for _, s := range states[1:] {
		if s != states[0] {
			return strings.Join(states, "+")
		}
	}
	return states[0]
}

// awaitHealth follows the first claim's health until it has read each of
// expect in turn, printing each change on stderr for whoever drives the host.
func (k *draKubelet) awaitHealth(p *draPlugin, uid string, prepared draPrepared, expect []string, timeout time.Duration) error {
	if len(prepared.Devices) == 0 {
		return fmt.Errorf("claim %s was prepared with no devices: %q", uid, prepared.Error)
	}
	start := time.Now()
	deadline := start.Add(timeout)
	last := ""
	for len(expect) > 0 {
		now := k.claimHealth(p.Name, prepared)
		if now != last {
			last = now
			k.mu.Lock()
			k.rep.HealthSeen = append(k.rep.HealthSeen, healthSeen{now, float64(time.Since(start).Microseconds()) / 1000})
			k.mu.Unlock()
			fmt.Fprintf(os.Stderr, "health %s %s\n", uid, now)
			if now == expect[0] {
				expect = expect[1:]
				continue
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("claim %s still reads %s, not %s, after %v", uid, last, expect[0], timeout)
		}
		time.Sleep(5 * time.Millisecond)
	}
	return nil
}
