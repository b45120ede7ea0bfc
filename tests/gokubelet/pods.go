// The pod side of gokubelet: the device manager's pod devices, its checkpoint,
// the PodResources List API and a kubelet's start-up, as the real kubelet has
// them (pkg/kubelet/cm/devicemanager/manager.go, .../checkpoint/checkpoint.go,
// pkg/kubelet/apis/podresources/server_v1.go):
//
//   - kubelet_internal_checkpoint in the device-plugin directory is read back
//     at every start, before kubelet.sock is served, and written (whole, to a
//     temporary file renamed over it) at every device list and admission;
//   - a kubelet that has just started answers PodResources List before it has
//     synced its pods: nothing listens for -sync-refuse, then List lists no
//     pods for -sync-empty, then the active pods (-pods, and those admitted);
//   - once synced, List and each admission drop the devices of pods that are
//     not active (UpdateAllocatedDevices); a device in the pod devices is never
//     given to another pod.
//
// -admit RESOURCE admits pod default/vm-a with one device of RESOURCE as soon
// as the resources are listed; -admit-after RESOURCE admits default/vm-b once
// the kubelet has synced (and -admit-delay more), as new pods come with the
// pods the kubelet already has. The report says which devices each pod holds,
// or why an admission failed.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"hash/fnv"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
)

var (
	syncRefuse = flag.Duration("sync-refuse", 0, "after a start, nothing listens on the PodResources socket for this long")
	syncEmpty  = flag.Duration("sync-empty", 0, "then PodResources List lists no pods for this long, before it lists them")
	activePods = flag.String("pods", "", "pods the API server has bound here at start: namespace/name=uid, comma separated")
	admitFirst = flag.String("admit", "", "admit default/vm-a with one device of this resource once it is listed")
	admitAfter = flag.String("admit-after", "", "admit default/vm-b with one device of this resource once the kubelet has synced")
	admitDelay = flag.Duration("admit-delay", 0, "how long after the sync -admit-after waits")
)

const checkpointFile = "kubelet_internal_checkpoint"

// podEntry is checkpoint.PodDevicesEntry.
type podEntry struct {
	PodUID        string
	ContainerName string
	ResourceName  string
	DeviceIDs     map[int64][]string
	AllocResp     []byte
}

type checkpointData struct {
	PodDeviceEntries  []podEntry
	RegisteredDevices map[string][]string
}

type checkpointDoc struct {
	Data     checkpointData
	Checksum uint64
}

type podInfo struct {
	namespace, name string
}

type podReport struct {
	UID     string              `json:"uid"`
	Devices map[string][]string `json:"devices"`
}

// pods is the kubelet's pod state; its own lock, never held with kubelet.mu.
type pods struct {
	mu         sync.Mutex
	dir        string
	entries    []podEntry         // the device manager's podDevices
	active     map[string]podInfo // by UID: the pods the API server has bound here
	syncedAt   time.Time
	writes     int
	prPath     string
	prServer   *grpc.Server
	prTimer    *time.Timer
	generation int
}

func newPods(dir string) *pods {
	p := &pods{dir: dir, active: map[string]podInfo{}}
	for _, item := range strings.Split(*activePods, ",") {
		if item == "" {
			continue
		}
		key, uid, _ := strings.Cut(item, "=")
		namespace, name, _ := strings.Cut(key, "/")
		p.active[uid] = podInfo{namespace, name}
	}
	return p
}

// begin is what a kubelet does as it starts: read its checkpoint back, and
// start syncing its pods.
func (p *pods) begin(now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.entries = nil
	if data, err := os.ReadFile(filepath.Join(p.dir, checkpointFile)); err == nil {
		var doc checkpointDoc
		if json.Unmarshal(data, &doc) == nil {
			p.entries = doc.Data.PodDeviceEntries
		}
	}
	p.syncedAt = now.Add(*syncRefuse + *syncEmpty)
	if p.prPath != "" {
		p.generation++
		generation := p.generation
		p.prTimer = time.AfterFunc(*syncRefuse, func() { p.serve(generation) })
	}
}

func (p *pods) synced() bool {
	return !time.Now().Before(p.syncedAt)
}

// dropInactive is UpdateAllocatedDevices; p.mu is held.
func (p *pods) dropInactive() {
	if !p.synced() {
		return
	}
	kept := p.entries[:0]
	for _, e := range p.entries {
		if _, ok := p.active[e.PodUID]; ok {
			kept = append(kept, e)
		}
	}
	p.entries = kept
}

func (p *pods) inUse(resource string) map[string]bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropInactive()
	used := map[string]bool{}
	for _, e := range p.entries {
		if e.ResourceName != resource {
			continue
		}
		for _, ids := range e.DeviceIDs {
			for _, id := range ids {
				used[id] = true
			}
		}
	}
	return used
}

// write is writeCheckpoint: the pod devices and each resource's healthy devices.
func (p *pods) write(registered map[string][]string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	data := checkpointData{PodDeviceEntries: p.entries, RegisteredDevices: registered}
	blob, err := json.Marshal(data)
	if err != nil {
		return err
	}
	// The kubelet's checksum hashes Go's printing of the data; this stands in.
	sum := fnv.New32a()
	sum.Write(blob)
	out, err := json.Marshal(checkpointDoc{Data: data, Checksum: uint64(sum.Sum32())})
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(p.dir, "."+checkpointFile)
	if err != nil {
		return err
	}
	if _, err = tmp.Write(out); err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(p.dir, checkpointFile))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return err
	}
	p.writes++
	return nil
}

func (p *pods) report() map[string]podReport {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := map[string]podReport{}
	for _, e := range p.entries {
		info, ok := p.active[e.PodUID]
		if !ok {
			continue
		}
		key := info.namespace + "/" + info.name
		r, ok := out[key]
		if !ok {
			r = podReport{UID: e.PodUID, Devices: map[string][]string{}}
		}
		for _, ids := range e.DeviceIDs {
			r.Devices[e.ResourceName] = append(r.Devices[e.ResourceName], ids...)
		}
		sort.Strings(r.Devices[e.ResourceName])
		out[key] = r
	}
	return out
}

// ---------------------------------------------------------------- PodResources

// serve listens on the PodResources socket (removing a stale one first, as
// the kubelet's listener does) unless the kubelet stopped meanwhile.
func (p *pods) serve(generation int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if generation != p.generation {
		return
	}
	_ = os.Remove(p.prPath)
	lis, err := net.Listen("unix", p.prPath)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gokubelet: pod resources:", err)
		return
	}
	server := grpc.NewServer(grpc.CustomCodec(rawCodec{}))
	server.RegisterService(&grpc.ServiceDesc{
		ServiceName: "v1.PodResourcesLister",
		HandlerType: (*interface{})(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "List",
			Handler: func(_ interface{}, ctx context.Context, dec func(interface{}) error, _ grpc.UnaryServerInterceptor) (interface{}, error) {
				var in []byte
				if err := dec(&in); err != nil {
					return nil, err
				}
				answer := p.list()
				return &answer, nil
			},
		}},
		Streams: []grpc.StreamDesc{},
	}, struct{}{})
	p.prServer = server
	go func() { _ = server.Serve(lis) }()
}

// stop is the kubelet going away: its PodResources server goes with it (the
// socket file stays, as a killed kubelet's does).
func (p *pods) stop() {
	p.mu.Lock()
	p.generation++
	server, timer := p.prServer, p.prTimer
	p.prServer, p.prTimer = nil, nil
	p.mu.Unlock()
	if timer != nil {
		timer.Stop()
	}
	if server != nil {
		server.Stop()
	}
}

// list answers List: no pods until synced, then every active pod with the
// devices the device manager gave each of its containers.
func (p *pods) list() []byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.synced() {
		return []byte{}
	}
	p.dropInactive()
	containers := map[string]map[string][]byte{} // uid -> container -> ContainerResources fields
	for _, e := range p.entries {
		var devices []byte
		devices = appendBytes(devices, 1, []byte(e.ResourceName))
		for _, ids := range e.DeviceIDs {
			for _, id := range ids {
				devices = appendBytes(devices, 2, []byte(id))
			}
		}
		if containers[e.PodUID] == nil {
			containers[e.PodUID] = map[string][]byte{}
		}
		containers[e.PodUID][e.ContainerName] = appendBytes(containers[e.PodUID][e.ContainerName], 2, devices)
	}
	var uids []string
	for uid := range p.active {
		uids = append(uids, uid)
	}
	sort.Strings(uids)
	var out []byte
	for _, uid := range uids {
		info := p.active[uid]
		var pod []byte
		pod = appendBytes(pod, 1, []byte(info.name))
		pod = appendBytes(pod, 2, []byte(info.namespace))
		for name, fields := range containers[uid] {
			pod = appendBytes(pod, 3, append(appendBytes(nil, 1, []byte(name)), fields...))
		}
		out = appendBytes(out, 1, pod)
	}
	return out
}

// ---------------------------------------------------------------- admission

// admit admits one container of pod namespace/name with `count` devices of
// resource, as the device manager does: the healthy devices no pod holds,
// the plugin's preference among them, then Allocate; recorded (and the
// checkpoint written) only if it succeeds.
func (k *kubelet) admit(uid, namespace, name, resource string, count int) error {
	k.mu.Lock()
	r := k.res[resource]
	var ep *endpoint
	var devices []device
	if r != nil {
		ep, devices = r.ep, append([]device(nil), r.Devices...)
	}
	k.mu.Unlock()
	if ep == nil {
		return fmt.Errorf("UnexpectedAdmissionError: cannot allocate unregistered device %s", resource)
	}
	used := k.pods.inUse(resource)
	var available []string
	numa := map[string][]int64{}
	for _, d := range devices {
		if d.Health == "Healthy" && !used[d.ID] {
			available = append(available, d.ID)
			numa[d.ID] = d.NUMA
		}
	}
	if len(available) < count {
		return fmt.Errorf("UnexpectedAdmissionError: requested number of devices unavailable for %s. Requested: %d, Available: %d", resource, count, len(available))
	}
	chosen := available[:count]
	if ep.options.PreferredAllocationOffered {
		answer, err := preferred(ep, available, nil, count)
		if err != nil {
			return fmt.Errorf("UnexpectedAdmissionError: GetPreferredAllocation: %v", err)
		}
		if len(answer) == 1 && len(answer[0]) == count {
			chosen = answer[0]
		}
	}
	var reply []byte
	if err := ep.conn.Invoke(context.Background(), pluginService+"Allocate", encodeAllocate(chosen), &reply); err != nil {
		return fmt.Errorf("UnexpectedAdmissionError: Allocate failed due to %v", err)
	}
	containers, err := messages(reply, 1)
	if err != nil || len(containers) == 0 {
		return fmt.Errorf("UnexpectedAdmissionError: no containers return in allocation response")
	}
	perNUMA := map[int64][]string{}
	for _, id := range chosen {
		nodes := numa[id]
		if len(nodes) == 0 {
			nodes = []int64{-1}
		}
		for _, n := range nodes {
			perNUMA[n] = append(perNUMA[n], id)
		}
	}
	first, _ := messageBytes(reply, 1)
	k.pods.mu.Lock()
	k.pods.active[uid] = podInfo{namespace, name}
	k.pods.entries = append(k.pods.entries, podEntry{uid, "compute", resource, perNUMA, first})
	k.pods.mu.Unlock()
	return k.writeCheckpoint()
}

// messageBytes is the first occurrence of field `num` of `b`, as bytes.
func messageBytes(b []byte, num int) ([]byte, error) {
	fs, err := fields(b)
	for _, f := range fs {
		if f.num == num {
			return f.bytes, err
		}
	}
	return nil, err
}

func (k *kubelet) writeCheckpoint() error {
	k.mu.Lock()
	registered := map[string][]string{}
	for name, r := range k.res {
		for _, d := range r.Devices {
			if r.ep != nil && d.Health == "Healthy" {
				registered[name] = append(registered[name], d.ID)
			}
		}
	}
	k.mu.Unlock()
	return k.pods.write(registered)
}

// runPods is the -admit / -admit-after scenario, after the resources are listed.
func runPods(k *kubelet, rep *report, start time.Time) {
	if *admitFirst != "" {
		if err := k.admit("uid-vm-a", "default", "vm-a", *admitFirst, 1); err != nil {
			rep.AdmitErrors = append(rep.AdmitErrors, "default/vm-a: "+err.Error())
		}
	}
	if *admitAfter != "" {
		k.pods.mu.Lock()
		wait := time.Until(k.pods.syncedAt.Add(*admitDelay))
		k.pods.mu.Unlock()
		time.Sleep(wait)
		if err := k.admit("uid-vm-b", "default", "vm-b", *admitAfter, 1); err != nil {
			rep.AdmitErrors = append(rep.AdmitErrors, "default/vm-b: "+err.Error())
		}
	}
	rep.Pods = k.pods.report()
	k.pods.mu.Lock()
	rep.SyncedS = k.pods.syncedAt.Sub(start).Seconds()
	rep.CheckpointWrites = k.pods.writes
	k.pods.mu.Unlock()
}
