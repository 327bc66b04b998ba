package service

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/internal/natstest"
	"github.com/delaybridge/delaybridge/internal/testlog"
)

// A NATS cluster that loses its quorum: the remaining server answers the
// JetStream API with 503 "JetStream system temporarily unavailable" once
// it has been without its peers for the servers' lost-quorum interval
// (about 10 s). These tests wait that out, so they run in the long form
// only (DELAYBRIDGE_LONG=1); TestUnreachable and
// TestNotReadyWhileConsumerUnanswered cover the same code in CI.

// clusterClient is a test client of a NATS cluster at url (one server's,
// or all of them) that reconnects for ever, and its JetStream context.
func clusterClient(t *testing.T, url string) (*natsgo.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := natsgo.Connect(url, natsgo.Name("test-client"), natsgo.MaxReconnects(-1), natsgo.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return nc, js
}

// longNATSCluster starts a 3-node cluster (long form only) with an R3
// DELAY stream and R3 streams; it returns a test client on every server.
func longNATSCluster(t *testing.T, streams ...jetstream.StreamConfig) (*natstest.Cluster, *natsgo.Conn, jetstream.JetStream) {
	t.Helper()
	if os.Getenv("DELAYBRIDGE_LONG") != "1" {
		t.Skip("long form only (DELAYBRIDGE_LONG=1): a NATS cluster's elections and lost-quorum interval take seconds")
	}
	c := natstest.StartCluster(t, 3)
	nc, js := clusterClient(t, c.URLs())
	streams = append([]jetstream.StreamConfig{
		{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy, Replicas: 3, Duplicates: nats.MinDuplicateWindow},
	}, streams...)
	for _, sc := range streams {
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			_, err := js.CreateStream(ctx, sc)
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("create stream %s: %v", sc.Name, err)
			}
		}
	}
	return c, nc, js
}

var ordersR3 = jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Replicas: 3}

// clusterYAML is a NATS-only bridge config on url; extra is added at the
// top level.
func clusterYAML(t *testing.T, url, extra string) string {
	return fmt.Sprintf(`
data_dir: %q
shards: 2
%s
nats:
  url: %q
  stream: DELAY
  consumer: bridge
  create: true
  replicas: 3
  sources:
    - {subject: "delay.>", dlq: dlq.delay}
targets:
  allow: ["*"]
admin:
  listen: "127.0.0.1:0"
`, t.TempDir(), extra, url)
}

// TestStartWhileNATSClusterLostQuorum: the bridge starts while two of the
// three servers are down (a rolling restart gone wrong, a zone outage). It
// must wait, not ready and saying why, and come up once the cluster has
// its quorum again; it used to exit on the 503 (a crash loop, taking a
// Kafka side down with it).
func TestStartWhileNATSClusterLostQuorum(t *testing.T) {
	c, _, _ := longNATSCluster(t, ordersR3)
	c.Stop(1)
	c.Stop(2)
	time.Sleep(11 * time.Second) // the lost-quorum interval: then the 503s

	svc, _, done := runYAML(t, clusterYAML(t, c.URL(0), ""), Options{Logger: testlog.New(t, zaptest.Level(testLogLevel())), NATS: fastNATS})
	alive := exitWatch(t, done)
	eventually(t, "not ready, saying JetStream is unavailable", func() bool {
		alive()
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "temporarily unavailable")
	})
	c.Start(1)
	c.Start(2)
	eventually(t, "ready once the quorum is back", func() bool { alive(); return svc.Ready() == nil })
}

// TestNotReadyWhileNATSQuorumLost: the bridge runs; two of three servers
// go down. The delay consumer has no leader, its requests are answered
// 503 (while a replica still answers for the stream), and nothing is
// consumed: the bridge is not ready, and stays so until the quorum is
// back. It used to stay ready.
func TestNotReadyWhileNATSQuorumLost(t *testing.T) {
	c, _, _ := longNATSCluster(t, ordersR3)
	svc, _, done := runYAML(t, clusterYAML(t, c.URL(0), ""), Options{Logger: testlog.New(t, zaptest.Level(testLogLevel())), NATS: fastNATS})
	alive := exitWatch(t, done)
	eventually(t, "ready", func() bool { alive(); return svc.Ready() == nil })
	c.Stop(1)
	c.Stop(2)
	eventually(t, "not ready once the quorum is lost", func() bool { alive(); return svc.Ready() != nil })
	for until := time.Now().Add(15 * time.Second); time.Now().Before(until); time.Sleep(50 * time.Millisecond) {
		if svc.Ready() == nil {
			t.Fatal("ready again while the cluster has no quorum: the source cannot consume")
		}
	}
	c.Start(1)
	c.Start(2)
	eventually(t, "ready once the quorum is back", func() bool { alive(); return svc.Ready() == nil })
}

// TestNATSClusterFaults: R3 delay, target and DLQ streams on a 3-node
// cluster; while the bridge ingests and fires 1200 tasks, leaders step
// down and servers go away and come back. Every task arrives, none is
// dead-lettered (an election is an outage, not a failed attempt), and the
// bridge is ready again; duplicates only of what was in flight at a fault
// (the target's 100 ms duplicate window lets them show; a fault rarely
// has more than a handful in flight). Run one case with
// NATS_CLUSTER_CASE=name.
func TestNATSClusterFaults(t *testing.T) {
	stepdown := func(subj string) func(*testing.T, *natstest.Cluster, *natsgo.Conn) {
		return func(t *testing.T, _ *natstest.Cluster, nc *natsgo.Conn) {
			for range 20 {
				m, err := nc.Request(subj, nil, 2*time.Second)
				if err == nil && !strings.Contains(string(m.Data), `"error"`) {
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
			t.Fatalf("%s: no leader stepped down", subj)
		}
	}
	consumerStep := stepdown("$JS.API.CONSUMER.LEADER.STEPDOWN.DELAY.bridge")
	streamStep := stepdown("$JS.API.STREAM.LEADER.STEPDOWN.DELAY")
	targetStep := stepdown("$JS.API.STREAM.LEADER.STEPDOWN.ORDERS")
	bounce := func(pick func(c *natstest.Cluster) int) func(*testing.T, *natstest.Cluster, *natsgo.Conn) {
		return func(t *testing.T, c *natstest.Cluster, _ *natsgo.Conn) {
			i := pick(c)
			if i < 0 {
				t.Fatal("no server to stop")
			}
			t.Logf("stopping server %d (bridge on %d, DELAY leader %d, consumer leader %d)",
				i, c.ServerOf("delaybridge"), c.StreamLeader("DELAY"), c.ConsumerLeader("DELAY", "bridge"))
			c.Stop(i)
			time.Sleep(2 * time.Second)
			c.Start(i)
		}
	}
	type fault = func(*testing.T, *natstest.Cluster, *natsgo.Conn)
	for _, tc := range []struct {
		name   string
		faults []fault
	}{
		{"delay-stream-stepdown", []fault{streamStep}},
		{"consumer-stepdown", []fault{consumerStep}},
		{"target-stepdown", []fault{targetStep}},
		{"consumer-stepdowns-5", []fault{consumerStep, consumerStep, consumerStep, consumerStep, consumerStep}},
		{"mixed-stepdowns", []fault{consumerStep, streamStep, targetStep, consumerStep, streamStep}},
		{"bridge-server-down", []fault{bounce(func(c *natstest.Cluster) int { return c.ServerOf("delaybridge") })}},
		{"consumer-leader-down", []fault{bounce(func(c *natstest.Cluster) int { return c.ConsumerLeader("DELAY", "bridge") })}},
		{"delay-leader-down", []fault{bounce(func(c *natstest.Cluster) int { return c.StreamLeader("DELAY") })}},
	} {
		if f := os.Getenv("NATS_CLUSTER_CASE"); f != "" && f != tc.name {
			continue
		}
		t.Run(tc.name, func(t *testing.T) { runClusterFaults(t, tc.faults) })
	}
}

func runClusterFaults(t *testing.T, faults []func(*testing.T, *natstest.Cluster, *natsgo.Conn)) {
	c, nc, js := longNATSCluster(t,
		// A short duplicate window on the target: what the bridge sends twice shows.
		jetstream.StreamConfig{Name: "ORDERS", Subjects: []string{"orders.>"}, Replicas: 3, Duplicates: 100 * time.Millisecond},
		jetstream.StreamConfig{Name: "DLQ", Subjects: []string{"dlq.>"}, Replicas: 3})
	// Few attempts: a fault charged as a failed publish would dead-letter.
	yml := clusterYAML(t, c.URL(0), "retry: {initial: 200ms, max: 1s, multiplier: 2, jitter: 0.1, max_attempts: 4}")
	svc, _, done := runYAML(t, yml, Options{Logger: testlog.New(t, zaptest.Level(zapcore.WarnLevel)),
		NATS: func(c *nats.Config) { fastNATS(c); c.PublishTimeout = 3 * time.Second; c.AckWait = 3 * time.Second }})
	alive := exitWatch(t, done)
	eventually(t, "ready", func() bool { alive(); return svc.Ready() == nil })

	var mu sync.Mutex
	got := map[string]int{}
	var dlq atomic.Int64
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	for _, stream := range []string{"ORDERS", "DLQ"} {
		oc, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		cc, err := oc.Consume(func(m jetstream.Msg) {
			if stream == "DLQ" {
				dlq.Add(1)
				t.Logf("dead letter: %s %v", m.Data(), m.Headers())
				return
			}
			mu.Lock()
			got[string(m.Data())]++
			mu.Unlock()
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(cc.Stop)
	}

	// The publisher: each task due about 1 s after it is sent.
	const n = 1200
	published, wait := publishStream(t, js, "t", n, time.Second, 8*time.Millisecond, "orders.out")
	for k, f := range faults {
		eventually(t, "tasks published", func() bool { alive(); return published() > n/4+k*n/(2*len(faults)) })
		f(t, c, nc)
	}
	wait()
	delivered := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(got)
	}
	eventually(t, "every task delivered", func() bool { alive(); return delivered() == n })
	eventually(t, "ready after the faults", func() bool { alive(); return svc.Ready() == nil })
	mu.Lock()
	var dups []string
	for id, k := range got {
		if k > 1 {
			dups = append(dups, fmt.Sprintf("%s x%d", id, k))
		}
	}
	mu.Unlock()
	slices.Sort(dups)
	t.Logf("delivered %d tasks; %d duplicates %v", n, len(dups), dups)
	if dlq.Load() > 0 {
		t.Errorf("%d dead letters during leader changes", dlq.Load())
	}
	if limit := 20 * len(faults); len(dups) > limit {
		t.Errorf("%d duplicates for %d faults: more than the sends in flight at them could be", len(dups), len(faults))
	}
}

// exitWatch returns a check that fails the test if the bridge's Run
// (done) has returned.
func exitWatch(t *testing.T, done <-chan error) func() {
	return func() {
		t.Helper()
		select {
		case err := <-done:
			t.Fatalf("the bridge exited: %v", err)
		default:
		}
	}
}
