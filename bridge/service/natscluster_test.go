package service

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap/zaptest"

	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/internal/natstest"
)

// A NATS cluster that loses its quorum: the remaining server answers the
// JetStream API with 503 "JetStream system temporarily unavailable" once
// it has been without its peers for the servers' lost-quorum interval
// (about 10 s). These tests wait that out, so they run in the long form
// only (DELAYBRIDGE_LONG=1); TestUnreachable and
// TestNotReadyWhileConsumerUnanswered cover the same code in CI.

func longNATSCluster(t *testing.T) *natstest.Cluster {
	t.Helper()
	if os.Getenv("DELAYBRIDGE_LONG") != "1" {
		t.Skip("long form only (DELAYBRIDGE_LONG=1): waits out a NATS cluster's lost-quorum interval")
	}
	c := natstest.StartCluster(t, 3)
	nc, err := natsgo.Connect(c.URLs())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	for _, sc := range []jetstream.StreamConfig{
		{Name: "DELAY", Subjects: []string{"delay.>"}, Retention: jetstream.WorkQueuePolicy, Replicas: 3, Duplicates: nats.MinDuplicateWindow},
		{Name: "ORDERS", Subjects: []string{"orders.>"}, Replicas: 3},
	} {
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
	return c
}

func clusterYAML(t *testing.T, url string) string {
	return fmt.Sprintf(`
data_dir: %q
shards: 2
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
`, t.TempDir(), url)
}

// TestStartWhileNATSClusterLostQuorum: the bridge starts while two of the
// three servers are down (a rolling restart gone wrong, a zone outage). It
// must wait, not ready and saying why, and come up once the cluster has
// its quorum again; it used to exit on the 503 (a crash loop, taking a
// Kafka side down with it).
func TestStartWhileNATSClusterLostQuorum(t *testing.T) {
	c := longNATSCluster(t)
	c.Stop(1)
	c.Stop(2)
	time.Sleep(11 * time.Second) // the lost-quorum interval: then the 503s

	svc, _, done := runYAML(t, clusterYAML(t, c.URL(0)), Options{Logger: zaptest.NewLogger(t, zaptest.Level(testLogLevel())), NATS: fastNATS})
	alive := func() {
		select {
		case err := <-done:
			t.Fatalf("the bridge exited while the NATS cluster had no quorum: %v", err)
		default:
		}
	}
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
	c := longNATSCluster(t)
	svc, _, done := runYAML(t, clusterYAML(t, c.URL(0)), Options{Logger: zaptest.NewLogger(t, zaptest.Level(testLogLevel())), NATS: fastNATS})
	alive := func() {
		select {
		case err := <-done:
			t.Fatalf("bridge exited: %v", err)
		default:
		}
	}
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
