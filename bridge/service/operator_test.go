package service

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/twmb/franz-go/pkg/kfake"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/bridge/nats"
)

// TestNATSUnreachableRetried: a NATS address that accepts the TCP
// connection but does not answer (a server still starting behind a load
// balancer, a port-forward without its backend), and a host name that
// does not resolve yet (a Service created after the bridge's pod), are
// brokers that do not answer: retried with backoff at start while /readyz
// says why, as Kafka's are. They ended Run at start.
func TestNATSUnreachableRetried(t *testing.T) {
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			held = append(held, c) // accept, never answer
		}
	}()
	for _, tc := range []struct{ name, url string }{
		{"silent server", "nats://" + silent.Addr().String()},
		{"unresolvable host", "nats://nosuchhost.invalid:4222"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			yml := `
data_dir: ` + strconv.Quote(t.TempDir()) + `
nats:
  url: ` + tc.url + `
  sources: [{subject: delay.>, dlq: dlq.delay}]
admin: {listen: "127.0.0.1:0"}
`
			svc, cancel, done := runYAML(t, yml, Options{NATS: func(c *nats.Config) { c.ConnectTimeout = 200 * time.Millisecond }})
			deadline := time.After(30 * time.Second) // turns a hang into a failure
			for {
				select {
				case err := <-done:
					t.Fatalf("Run ended at start with %v; want retries while /readyz says why", err)
				case <-deadline:
					t.Fatal("no not-ready reason naming the NATS connect")
				case <-time.After(20 * time.Millisecond):
				}
				if err := svc.Ready(); err != nil && strings.Contains(err.Error(), "connecting to brokers: nats") {
					break
				}
			}
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run after cancel = %v, want nil", err)
			}
		})
	}
}

// TestKafkaOutageLogVolume: while the Kafka cluster is down, the failed
// group joins (and kafka-go's own line for each) are logged once and then
// once per logthrottle.DefaultEvery with a count, not once per attempt: two Warn
// lines per attempt were about 120 a minute for Kafka alone, forever.
// Counted per attempt (delaybridge_source_errors_total), not per second.
func TestKafkaOutageLogVolume(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.SeedTopics(1, kafkaDelay, kafkaDLQ, kafkaOut))
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.WarnLevel)
	svc, _, _ := runKafkaOnly(t, kc.ListenAddrs(), Options{Logger: zap.New(core), Registry: prometheus.NewRegistry(),
		Kafka: func(c *kafka.Config) { fastKafka(c); c.JoinBackoff = 10 * time.Millisecond }})
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	kc.Close()
	const attempts = 30
	errorsOf := func() float64 {
		return testutil.ToFloat64(svc.m.SourceErrors.WithLabelValues(kafkaDelay))
	}
	eventually(t, "failed joins", func() bool { return errorsOf() >= attempts })
	n := 0
	for _, e := range logs.All() {
		if strings.Contains(e.Message, "join group failed") || strings.Contains(e.Message, "consumer group coordinator") {
			n++
		}
	}
	t.Logf("%v failed attempts, %d Warn lines about them (%d Warn lines in all)", errorsOf(), n, logs.Len())
	if n > 5 {
		t.Fatalf("%d Warn lines for %v failed joins of one outage; want the first and a rate-limited reminder", n, errorsOf())
	}
}

// TestMissingKafkaDLQAtStart: a configured dead-letter topic that does
// not exist is not noticed at start: the bridge is ready and says nothing,
// and the first bad message, possibly hours later, holds its partition
// (CONTRACT §3) until an operator creates the topic. The delay topic is
// checked at start (a Warn naming it, not ready); the DLQ, which the
// operator configured in the same block, should at least be named in a
// Warn at start.
func TestMissingKafkaDLQAtStart(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.SeedTopics(1, kafkaDelay, kafkaOut)) // no delay.dlq
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	core, logs := observer.New(zap.WarnLevel)
	svc, _, _ := runKafkaOnly(t, kc.ListenAddrs(), Options{Logger: zap.New(core), Kafka: fastKafka})
	// Ready is computed after connect completes, so the start checks are done.
	eventually(t, "connected", func() bool {
		for _, l := range svc.late {
			if l.real.Load() == nil {
				return false
			}
		}
		return true
	})
	for _, e := range logs.All() {
		if strings.Contains(e.Message+fmt.Sprint(e.ContextMap()), kafkaDLQ) {
			t.Logf("warned: %s %v", e.Message, e.ContextMap())
			return
		}
	}
	t.Fatalf("started with the DLQ topic %q missing and no Warn naming it (Ready = %v)", kafkaDLQ, svc.Ready())
}
