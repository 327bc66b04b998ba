package service

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/natstest"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// counterSum is the sum of every series of a counter vector.
func counterSum(c prometheus.Collector) float64 {
	ch := make(chan prometheus.Metric, 64)
	go func() { c.Collect(ch); close(ch) }()
	var sum float64
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err == nil && d.Counter != nil {
			sum += d.Counter.GetValue()
		}
	}
	return sum
}

// TestOneNATSStreamDownAmongHealthy (hunt H182): a 3-node JetStream
// cluster with several R1 target streams on different servers and an R3
// one; the server of one R1 target stream stops for 5 fake minutes under
// steady traffic to every target, then comes back. The down stream's
// tasks wait as in an outage (no attempt charged, no dead letter), the
// healthy streams' tasks are on time, the outage is one Warn line and
// readiness does not flap, and the down stream's tasks go soon after its
// return, each once. Measured (H182): the R1 stream's failures are "no
// response from stream", ErrUnavailable; 0 refusals, 0 dead letters, one
// Warn and one Info line per shard, healthy tasks 0 s late, the last
// waiting task delivered 1-2 fake s after the return. In the R3 quorum
// loss the leader takes publishes without acknowledging them until it
// steps down: each Deliver holding a task of it waits PublishTimeout, and
// the healthy tasks of that batch with it (two batches of 10 s with the
// default, seven of 3 s with 3 s); no task is lost or charged. Since hunt
// H184 the sink cuts such a straggler once the rest of its batch has its
// answers (bridge/nats TestStragglerOfQuorumLostStream), and since the
// nineteenth session a batch of the straggler alone too, 1 s after another
// lane's PubAck or an answer of the JetStream API to a ping
// (TestLoneStragglerCutWhenOthersAnswer): the longest real wait for a
// healthy task went from 6.0 s (3 s timeout) and 9.0 s (10 s) to 1.0 s
// in 4 of 6 runs and 5.0 s in the other 2 (three runs of both subtests).
// Without the ping, 5 of 8 runs with the 10 s timeout stayed at 9.8-9.9
// s: the stuck task's batch of one was the only one in flight and nothing
// was acknowledged since it was sent (this test's fake clock moves on only
// once the healthy tasks arrive, so no other lane publishes).
// DELAYBRIDGE_LONG=1 runs it (about 100 s).
func TestOneNATSStreamDownAmongHealthy(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_LONG") != "1" {
		t.Skip("long form only (DELAYBRIDGE_LONG=1)")
	}
	t.Run("default", func(t *testing.T) { runOneStreamDown(t, nil) })
	// The sink's finding that a stream captures the subject expires
	// during the outage (NoStreamTTL is real time, 30 s by default: the
	// fake 5 minutes take less), so each retry asks the servers again; with
	// core_targets a wrong "no stream" would send the tasks to nobody.
	t.Run("lookups-core-targets", func(t *testing.T) {
		runOneStreamDown(t, func(c *nats.Config) { c.NoStreamTTL = 100 * time.Millisecond; c.CoreTargets = true })
	})
	// An R3 target stream loses its quorum (two followers stopped in a
	// 5-node cluster): its leader takes publishes and cannot acknowledge
	// them until it steps down.
	t.Run("r3-quorum-lost", func(t *testing.T) { runOneStreamQuorumLost(t, nil) })
	t.Run("r3-quorum-lost-default-timeout", func(t *testing.T) {
		runOneStreamQuorumLost(t, func(c *nats.Config) { c.PublishTimeout = 10 * time.Second })
	})
}

func runOneStreamQuorumLost(t *testing.T, hook func(*nats.Config)) {
	c := natstest.StartCluster(t, 5)
	nc, err := natsgo.Connect(c.URL(0), natsgo.Name("creator"), natsgo.MaxReconnects(-1), natsgo.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js0, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	create := func(js jetstream.JetStream, sc jetstream.StreamConfig) jetstream.Stream {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			st, err := js.CreateStream(ctx, sc)
			cancel()
			if err == nil {
				within(t, sc.Name+" leader", 20*time.Second, func() bool { return c.StreamLeader(sc.Name) >= 0 })
				return st
			}
			if time.Now().After(deadline) {
				t.Fatalf("create stream %s: %v", sc.Name, err)
			}
		}
	}
	create(js0, jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy, Replicas: 5, Duplicates: nats.MinDuplicateWindow})
	create(js0, jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, Replicas: 5})
	create(js0, jetstream.StreamConfig{Name: "TR5", Subjects: []string{"tr5.>"}, Replicas: 5})
	st := create(js0, jetstream.StreamConfig{Name: "TQ", Subjects: []string{"tq.>"}, Replicas: 3})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	info, err := st.Info(ctx)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	idx := func(name string) int { return int(name[1] - '1') } // "S3" -> 2
	peers := map[int]bool{idx(info.Cluster.Leader): true}
	var followers []int
	for _, r := range info.Cluster.Replicas {
		peers[idx(r.Name)] = true
		followers = append(followers, idx(r.Name))
	}
	bridgeAt := -1
	for i := range 5 {
		if !peers[i] {
			bridgeAt = i
			break
		}
	}
	if len(followers) != 2 || bridgeAt < 0 {
		t.Fatalf("TQ: leader %s replicas %+v", info.Cluster.Leader, info.Cluster.Replicas)
	}
	_, js := clusterClient(t, c.URL(bridgeAt))
	t.Logf("TQ leader %s, followers %v stopped; bridge on server %d; TR5's leader on server %d", info.Cluster.Leader, followers, bridgeAt, c.StreamLeader("TR5"))
	measureOneDown(t, c, js, c.URL(bridgeAt), 5, []string{"TR5", "TQ"},
		func() { c.Stop(followers[0]); c.Stop(followers[1]) },
		func() { c.Start(followers[0]); c.Start(followers[1]) }, time.Minute, hook)
}

func runOneStreamDown(t *testing.T, hook func(*nats.Config)) {
	c := natstest.StartCluster(t, 3)
	nc, js := clusterClient(t, c.URL(0))
	// A stream is created through a client on server via: the servers
	// place an R1 stream on the server its create came through.
	jsOn := map[int]jetstream.JetStream{0: js}
	for i := 1; i < 3; i++ {
		nci, err := natsgo.Connect(c.URL(i), natsgo.Name(fmt.Sprintf("creator-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		defer nci.Close()
		if jsOn[i], err = jetstream.New(nci); err != nil {
			t.Fatal(err)
		}
	}
	via := 0
	create := func(sc jetstream.StreamConfig) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			_, err := jsOn[via].CreateStream(ctx, sc)
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("create stream %s: %v", sc.Name, err)
			}
		}
		within(t, sc.Name+" leader", 20*time.Second, func() bool { return c.StreamLeader(sc.Name) >= 0 })
	}
	create(jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy, Replicas: 3, Duplicates: nats.MinDuplicateWindow})
	create(jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, Replicas: 3})
	create(jetstream.StreamConfig{Name: "TR3", Subjects: []string{"tr3.>"}, Replicas: 3})
	// Two R1 streams on two servers: the servers place R1 streams on one
	// server while they can, so the first one's server is stopped while
	// the second is created. The bridge and the test client are on
	// server 0, which stays up: the stream that goes down is the one not
	// on it.
	where := map[string]int{}
	create(jetstream.StreamConfig{Name: "T0", Subjects: []string{"t0.>"}, Replicas: 1})
	where["T0"] = c.StreamLeader("T0")
	c.Stop(where["T0"])
	via = (where["T0"] + 1) % 3
	create(jetstream.StreamConfig{Name: "T1", Subjects: []string{"t1.>"}, Replicas: 1})
	where["T1"] = c.StreamLeader("T1")
	c.Start(where["T0"])
	c.WaitMeta()
	via = 0
	within(t, "T0 back", 20*time.Second, func() bool { return c.StreamLeader("T0") >= 0 })
	down := "T0"
	if where["T0"] == 0 {
		down = "T1"
	}
	downServer := where[down]
	targets := []string{"TR3"} // every target stream but down must stay healthy
	for name, s := range where {
		if s != downServer {
			targets = append(targets, name)
		}
	}
	sort.Strings(targets)
	targets = append(targets, down)
	// TR3's leader off the server that stops: an election is an outage
	// of its own, and TR3 must stay healthy.
	for i := 0; c.StreamLeader("TR3") == downServer; i++ {
		if i == 20 {
			t.Fatal("TR3's leader stays on the server to stop")
		}
		_, _ = nc.Request("$JS.API.STREAM.LEADER.STEPDOWN.TR3", nil, 2*time.Second)
		within(t, "TR3 leader", 20*time.Second, func() bool { return c.StreamLeader("TR3") >= 0 })
	}
	t.Logf("R1 streams %v; down %s on server %d; targets %v; TR3 leader on %d", where, down, downServer, targets, c.StreamLeader("TR3"))
	measureOneDown(t, c, js, c.URL(0), 3, targets, func() { c.Stop(downServer) }, func() { c.Start(downServer) }, 5*time.Minute, hook)
}

// measureOneDown runs a bridge on url with a fake clock and steady
// traffic to every target stream (the last one is the one that goes
// down), stops the last one with stop for outage (fake), starts it again
// and checks what happened: see TestOneNATSStreamDownAmongHealthy.
func measureOneDown(t *testing.T, c *natstest.Cluster, js jetstream.JetStream, url string, replicas int, targets []string, stop, start func(), outage time.Duration, hook func(*nats.Config)) {
	down := targets[len(targets)-1]
	clk := clock.NewFake(time.Now())
	var pubTimeout time.Duration // the sink's, as set
	core, logs := observer.New(zap.InfoLevel)
	log := zap.New(zapcore.NewTee(core, testlog.New(t, zaptest.Level(zapcore.WarnLevel)).Core()))
	yml := clusterYAML(t, url, "retry: {initial: 1s, max: 8s, multiplier: 2, jitter: 0, max_attempts: 3}")
	// The delay consumer's replicas: on 5 servers, all of them, so that
	// the two stopped leave it its quorum.
	yml = strings.Replace(yml, "replicas: 3", fmt.Sprintf("replicas: %d", replicas), 1)
	svc, _, done := runYAML(t, yml, Options{Logger: log, Clock: clk,
		NATS: func(c *nats.Config) {
			fastNATS(c)
			c.PublishTimeout = 3 * time.Second
			if hook != nil {
				hook(c)
			}
			pubTimeout = c.PublishTimeout
		}})
	alive := exitWatch(t, done)
	within(t, "ready", 60*time.Second, func() bool { alive(); return svc.Ready() == nil })

	// What arrived on the healthy streams, with the fake time it was seen.
	var mu sync.Mutex
	seen := map[string]time.Time{}
	count := map[string]int{}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	for _, name := range targets[:len(targets)-1] {
		oc, err := js.OrderedConsumer(ctx, name, jetstream.OrderedConsumerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		cc, err := oc.Consume(func(m jetstream.Msg) {
			mu.Lock()
			defer mu.Unlock()
			if _, ok := seen[string(m.Data())]; !ok {
				seen[string(m.Data())] = clk.Now()
			}
			count[string(m.Data())]++
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cc.Stop)
	}

	type task struct {
		id  string
		due time.Time
	}
	var healthy []task
	var downIDs []string
	var downDue []time.Time
	published := 0
	step := 0
	// tick publishes one task per target due 2 fake seconds on, waits for
	// the bridge to have them, moves the clock 1 s and waits (3 s real at
	// most) for the healthy tasks due by then.
	var maxWait time.Duration
	var lateness []time.Duration
	var readiness []bool
	quiet := false // tick publishes nothing
	tick := func() {
		t.Helper()
		alive()
		due := clk.Now().Add(2 * time.Second)
		for _, name := range targets {
			if quiet {
				break
			}
			id := fmt.Sprintf("%s-%04d", strings.ToLower(name), step)
			m := delayMsg(id, strings.ToLower(name)+".out")
			m.Header.Set("delay-at", fmt.Sprint(due.UnixMilli()))
			if err := publishStored(js, m, 100); err != nil {
				t.Fatal(err)
			}
			published++
			if name == down {
				downIDs, downDue = append(downIDs, id), append(downDue, due)
			} else {
				healthy = append(healthy, task{id, due})
			}
		}
		step++
		within(t, "ingested", 30*time.Second, func() bool { return int(counterSum(svc.m.Ingested)) >= published })
		clk.Advance(time.Second)
		now, start := clk.Now(), time.Now()
		for time.Since(start) < pubTimeout+3*time.Second {
			mu.Lock()
			missing := 0
			for _, h := range healthy {
				if _, ok := seen[h.id]; !ok && !h.due.After(now) {
					missing++
				}
			}
			mu.Unlock()
			if missing == 0 {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		if w := time.Since(start); w > time.Second {
			t.Logf("tick %d (fake %s): healthy tasks due not seen after %v real", step, clk.Now().Format("15:04:05"), w)
		}
		maxWait = max(maxWait, time.Since(start))
		readiness = append(readiness, svc.Ready() == nil)
	}
	for range 20 {
		tick()
	}
	stop()
	stopped := clk.Now()
	t.Logf("stopped at fake %s", stopped.Format("15:04:05"))
	flips := func(r []bool) int {
		k := 0
		for i := 1; i < len(r); i++ {
			if r[i] != r[i-1] {
				k++
			}
		}
		return k
	}
	readiness = nil
	for clk.Now().Sub(stopped) < outage {
		tick()
	}
	outageReadiness := readiness
	retriesOutage := counterSum(svc.m.PublishRetries)
	t.Logf("outage of %v fake (%d ticks): readiness flips %d (ready in %d ticks); publish retries %v; dead letters %v; held %d; max real wait per tick %v; ready: %v",
		clk.Now().Sub(stopped), len(outageReadiness), flips(outageReadiness), countTrue(outageReadiness), retriesOutage,
		counterSum(svc.m.DeadLettered), svc.Engine().Stats().Held, maxWait, svc.Ready())
	start()
	within(t, down+" leader", 30*time.Second, func() bool { return c.StreamLeader(down) >= 0 })
	back := clk.Now()
	t.Logf("%s back at fake %s", down, back.Format("15:04:05"))
	var allAt time.Time
	for range 120 {
		tick()
		dueNow := 0
		for _, d := range downDue {
			if !d.After(clk.Now()) {
				dueNow++
			}
		}
		if k, err := streamMsgs(js, down); err == nil && int(k) >= dueNow {
			allAt = clk.Now()
			break
		}
	}
	if allAt.IsZero() {
		k, err := streamMsgs(js, down)
		got := map[string]int{}
		for _, m := range readStream(t, js, down) {
			got[m.data]++
		}
		for _, id := range downIDs {
			if got[id] != 1 {
				var infos []string
				for _, src := range []string{"DELAY", "nats:DELAY"} {
					ti, err := svc.Engine().Lookup(src, id)
					infos = append(infos, fmt.Sprintf("%s: %+v %v", src, ti, err))
				}
				t.Logf("%s: %d copies; %v", id, got[id], infos)
			}
		}
		t.Logf("stats %+v", svc.Engine().Stats())
		t.Fatalf("the down stream's tasks not delivered 120 fake s after its return: %d of %d (%v)", k, len(downIDs), err)
	}
	quiet = true
	for range 5 {
		tick()
	}
	t.Logf("down stream back: all its %d tasks delivered %v (fake) after its leader was back", len(downIDs), allAt.Sub(back))

	// Lateness of the healthy tasks (fake time seen - due).
	mu.Lock()
	for _, h := range healthy {
		if at, ok := seen[h.id]; ok {
			if at.Sub(h.due) > time.Second {
				t.Logf("%s due %s seen %s", h.id, h.due.Format("15:04:05.000"), at.Format("15:04:05.000"))
			}
			lateness = append(lateness, at.Sub(h.due))
		}
	}
	var missing, dups []string
	for _, h := range healthy {
		switch k := count[h.id]; {
		case k == 0:
			missing = append(missing, h.id)
		case k > 1:
			dups = append(dups, fmt.Sprintf("%s x%d", h.id, k))
		}
	}
	mu.Unlock()
	sort.Slice(lateness, func(i, j int) bool { return lateness[i] < lateness[j] })
	if len(lateness) > 0 {
		t.Logf("healthy lateness: p50 %v p99 %v max %v over %d tasks", lateness[len(lateness)/2], lateness[len(lateness)*99/100], lateness[len(lateness)-1], len(lateness))
	}
	if len(missing) > 0 || len(dups) > 0 {
		t.Errorf("healthy streams: %d missing %v, %d duplicates %v", len(missing), missing[:min(10, len(missing))], len(dups), dups)
	}
	if len(lateness) > 0 && lateness[len(lateness)-1] > 2*time.Second {
		t.Errorf("a healthy task was %v late", lateness[len(lateness)-1])
	}
	downMsgs := readStream(t, js, down)
	checkDelivered(t, downMsgs, strings.ToLower(down)+"-", 0, 0)
	dcount := map[string]int{}
	for _, m := range downMsgs {
		dcount[m.data]++
	}
	for _, id := range downIDs {
		if dcount[id] != 1 {
			t.Errorf("down stream: %s delivered %d times", id, dcount[id])
		}
	}
	warns := logs.FilterMessageSnippet("target broker unreachable").Len()
	infos := logs.FilterMessageSnippet("target broker reachable again").Len()
	refusals := logs.FilterMessageSnippet("target refused a publish").Len()
	releases := logs.FilterMessageSnippet("target back after an outage").Len()
	t.Logf("best-effort deliveries %v", counterSum(svc.m.BestEffort))
	t.Logf("logs: %d Warn unreachable, %d Info reachable again, %d refusals, %d releases; all Warn+ lines: %d", warns, infos, refusals, releases, logs.FilterLevelExact(zapcore.WarnLevel).Len())
	for _, e := range logs.FilterLevelExact(zapcore.WarnLevel).All() {
		t.Logf("warn: %s %v", e.Message, e.ContextMap())
	}
	if dl, _ := streamMsgs(js, "DLQ"); dl != 0 {
		t.Errorf("%d dead letters", dl)
	}
	if refusals != 0 {
		t.Errorf("the down stream's failures were charged as refusals: %d lines", refusals)
	}
	if flips(outageReadiness) > 1 {
		t.Errorf("readiness flapped during the outage: %d flips %v", flips(outageReadiness), outageReadiness)
	}
	if countTrue(outageReadiness) > 2 {
		t.Errorf("ready in %d of %d ticks with a target stream down", countTrue(outageReadiness), len(outageReadiness))
	}
	if warns > 2*2 || infos > 2 { // 2 shards: one each
		t.Errorf("%d Warn and %d Info outage lines", warns, infos)
	}
	if d := allAt.Sub(back); d > 20*time.Second {
		t.Errorf("the down stream's tasks went %v after its return (retry.max 8s)", d)
	}
	if err := svc.Ready(); err != nil {
		t.Errorf("not ready after the return: %v", err)
	}
}

func countTrue(b []bool) int {
	k := 0
	for _, v := range b {
		if v {
			k++
		}
	}
	return k
}

// TestCoreTargetWithoutSubscribers (hunt H182): with nats.core_targets, a
// task to a subject with neither a stream nor a subscriber is published
// with core NATS to nobody: it leaves the store, counted as fired and as a
// best-effort delivery (README: best effort), the same as one a
// subscriber got; without core_targets it is dead-lettered publish-failed.
func TestCoreTargetWithoutSubscribers(t *testing.T) {
	for _, coreTargets := range []bool{true, false} {
		t.Run(fmt.Sprint("core_targets=", coreTargets), func(t *testing.T) {
			e := newEnv(t, "shards: 1\nretry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
			e.mutate = func(c *config.Config) { c.NATS.CoreTargets = coreTargets }
			svc, _ := e.start()
			sub, err := e.nc.SubscribeSync("nostream.listened")
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			if err := e.nc.Flush(); err != nil {
				t.Fatal(err)
			}
			e.publishNATS("delay.c", []byte("nobody"), "delay-after", "0", "delay-target", "nostream.nobody", "delay-id", "c1")
			e.publishNATS("delay.c", []byte("someone"), "delay-after", "0", "delay-target", "nostream.listened", "delay-id", "c2")
			// Due at once: with core_targets they may be out before a
			// look at the pending count.
			eventually(t, "both ingested", func() bool {
				return svc.Engine().Stats().Pending+int64(counterSum(svc.m.BestEffort)) >= 2
			})
			for i := 0; svc.Engine().Stats().Pending > 0 && i < 600; i++ {
				e.clk.Advance(time.Second)
				time.Sleep(20 * time.Millisecond)
			}
			got, _ := sub.NextMsg(2 * time.Second)
			dl := byValue(e.deliveries(), "dlq.delay")
			if !coreTargets {
				dl = byValue(e.waitFor("dead letters", func(ds []delivery) bool { return len(byValue(ds, "dlq.delay")) >= 2 }), "dlq.delay")
			}
			t.Logf("pending %d; fired %v; best-effort %v; dead letters %v (%d in the DLQ stream: %v); the subscriber got %v",
				svc.Engine().Stats().Pending, counterSum(svc.m.Fired), counterSum(svc.m.BestEffort), counterSum(svc.m.DeadLettered), len(dl), keys(dl), got != nil)
			if p := svc.Engine().Stats().Pending; p != 0 {
				t.Fatalf("%d pending", p)
			}
			if coreTargets {
				// Both went out; nothing tells the one to nobody apart.
				if be := counterSum(svc.m.BestEffort); be != 2 || len(dl) != 0 {
					t.Errorf("best-effort %v, dead letters %v; want 2 and none", be, keys(dl))
				}
			} else if len(dl) != 2 || dl["nobody"][0].header("delay-error") != "publish-failed" || dl["someone"][0].header("delay-error") != "publish-failed" {
				t.Errorf("dead letters %v; want both publish-failed", keys(dl))
			}
		})
	}
}

func keys(m map[string][]delivery) []string {
	var out []string
	for k, v := range m {
		out = append(out, k+":"+v[0].header("delay-error"))
	}
	sort.Strings(out)
	return out
}
