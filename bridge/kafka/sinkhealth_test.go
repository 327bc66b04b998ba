package kafka

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// probeGoroutines counts the goroutines running a Sink's probe. Every
// test of the package closes its sinks, so outside a test's own sink this
// is zero.
func probeGoroutines() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	count := 0
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "bridge/kafka.(*Sink).probe(") {
			count++
		}
	}
	return count
}

func (s *Sink) probeRunning() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.probing
}

// After a connection-level outage the sink reports itself healthy again
// once the brokers answer, without any publish: it probes them while
// unhealthy. The probe runs only while unhealthy and stops with Close.
func TestSinkHealthRecoversWithoutPublish(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "out"))
	cfg := testConfig(t, c.ListenAddrs(), "")
	cfg.ProbeInterval = 15 * time.Millisecond
	cfg.DialTimeout = 2 * time.Second
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			_ = s.Close()
		}
	}()
	baseline := probeGoroutines()

	// Healthy: a publish works and no probe runs. The publish also fills
	// the transport's metadata cache, which outlives the outage.
	if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "before")}); errs != nil {
		t.Fatalf("Deliver: %v", errs)
	}
	if s.probeRunning() || probeGoroutines() != baseline {
		t.Fatal("a probe runs while the sink is healthy")
	}

	// Outage: the broker closes the connection on every request.
	var down atomic.Bool
	var apiVersionsDown, producesAfter atomic.Int64
	down.Store(true)
	c.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		if down.Load() {
			if req.Key() == int16(kmsg.ApiVersions) {
				apiVersionsDown.Add(1)
			}
			return nil, errors.New("injected outage: connection dropped"), true
		}
		if req.Key() == int16(kmsg.Produce) {
			producesAfter.Add(1)
		}
		return nil, nil, false
	})
	if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "during")}); len(errs) != 1 || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("Deliver during the outage: %v, want shard.ErrUnavailable", errs)
	}
	if err := s.Health(); err == nil {
		t.Fatal("Health nil after a publish failed for want of a broker")
	}
	if !s.probeRunning() {
		t.Fatal("no probe once unhealthy")
	}
	waitFor(t, "one probe goroutine", func() bool { return probeGoroutines() == baseline+1 })

	// While the outage lasts the probes fail and Health stays bad, with
	// the probe's error. Wait for several probes (each sends at least one
	// ApiVersions request, refused here), not for a time.
	seen := apiVersionsDown.Load()
	waitFor(t, "five refused probes", func() bool {
		if err := s.Health(); err == nil {
			t.Fatal("Health nil while the broker drops every connection")
		}
		return apiVersionsDown.Load() >= seen+5
	})
	if err := s.Health(); err == nil || !strings.Contains(err.Error(), "probe brokers") {
		t.Fatalf("Health during the outage = %v, want the probe's error", err)
	}

	// The outage ends; nothing is published, yet Health clears and the
	// probe goroutine ends.
	down.Store(false)
	waitFor(t, "Health nil after the outage", func() bool { return s.Health() == nil })
	waitFor(t, "the probe to end", func() bool { return !s.probeRunning() && probeGoroutines() == baseline })
	if n := producesAfter.Load(); n != 0 {
		t.Fatalf("%d produce requests after the outage: the recovery was to come from the probe", n)
	}

	// A second outage starts a probe again; Close stops it and waits.
	down.Store(true)
	if errs := s.Deliver(context.Background(), []*codec.Task{task("out", "k", "again")}); len(errs) != 1 {
		t.Fatalf("Deliver in the second outage: %v", errs)
	}
	if s.Health() == nil || !s.probeRunning() {
		t.Fatal("no probe after the second outage began")
	}
	closed = true
	_ = s.Close()
	if s.probeRunning() || probeGoroutines() != baseline {
		t.Fatalf("probe running %v, %d probe goroutines (baseline %d) after Close", s.probeRunning(), probeGoroutines(), baseline)
	}
	// A publish after Close fails, and starts no probe.
	_ = s.Deliver(context.Background(), []*codec.Task{task("out", "k", "closed")})
	if s.probeRunning() || probeGoroutines() != baseline {
		t.Fatal("a publish after Close started a probe")
	}
}

// A probe result counts only for the failure it started on: a publish that
// failed while the probe ran keeps its error even if the probe succeeded.
func TestSinkProbeKeepsNewerPublishFailure(t *testing.T) {
	s, err := NewSink(Config{Brokers: []string{"127.0.0.1:1"}, ProbeInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	epoch := func() uint64 {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.epoch
	}
	s.setHealth(nil, errors.New("kafka: publish: first failure"), []string{"out"})
	started := epoch()
	newer := errors.New("kafka: publish: failed while the probe ran")
	s.setHealth(nil, newer, []string{"other"})
	if s.probeDone(started, nil) {
		t.Fatal("a probe that started before the newer failure cleared it")
	}
	if err := s.Health(); err != newer {
		t.Fatalf("Health = %v, want the newer publish failure", err)
	}
	probeErr := errors.New("connection refused")
	if s.probeDone(epoch(), probeErr) {
		t.Fatal("a failed probe cleared Health")
	}
	if err := s.Health(); !errors.Is(err, probeErr) || !strings.Contains(err.Error(), "probe brokers") {
		t.Fatalf("Health = %v, want the probe's error with context", err)
	}
	if !s.probeDone(epoch(), nil) || s.Health() != nil {
		t.Fatalf("a probe of the current failure succeeded but Health = %v", s.Health())
	}
}
