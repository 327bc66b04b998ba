package kafka

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// A partial outage: topic "a" is led by broker 1, which is down, topic "b"
// by broker 2, which is up. Publishes to b succeed while a's tasks cannot
// be delivered; the sink stays unhealthy (no /readyz flapping) until a
// publish to a succeeds again.
func TestSinkPartialOutageStaysUnhealthy(t *testing.T) {
	const downLeader, upLeader = 1, 2
	c := newCluster(t, kfake.NumBrokers(3), kfake.SeedTopics(1, "a", "b"))
	if err := c.MoveTopicPartition("a", 0, downLeader); err != nil {
		t.Fatal(err)
	}
	if err := c.MoveTopicPartition("b", 0, upLeader); err != nil {
		t.Fatal(err)
	}
	var down atomic.Bool
	var produces [3]atomic.Int64
	c.Control(func(req kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		node := c.CurrentNode()
		if node == downLeader && down.Load() {
			return nil, errors.New("injected outage of the leader of a"), true
		}
		if req.Key() == int16(kmsg.Produce) && node >= 0 && int(node) < len(produces) {
			produces[node].Add(1)
		}
		return nil, nil, false
	})

	cfg := testConfig(t, c.ListenAddrs()[:1], "") // broker 0 leads nothing
	// No probe runs during the test: every change of Health comes from a
	// publish, so each assertion is about the publish just made.
	cfg.ProbeInterval = time.Hour
	cfg.DialTimeout = 2 * time.Second
	s, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()

	deliver := func(step string, wantFail map[string]bool, tasks ...*codec.Task) {
		t.Helper()
		errs := s.Deliver(context.Background(), tasks)
		for i, tk := range tasks {
			var err error
			if errs != nil {
				err = errs[i]
			}
			switch {
			case wantFail[tk.Target] && !errors.Is(err, shard.ErrUnavailable):
				t.Fatalf("%s: task to %q: %v, want shard.ErrUnavailable", step, tk.Target, err)
			case !wantFail[tk.Target] && err != nil:
				t.Fatalf("%s: task to %q: %v", step, tk.Target, err)
			}
		}
	}
	unhealthy := func(step string) {
		t.Helper()
		if s.Health() == nil {
			t.Fatalf("%s: Health nil while the leader of a is down and a's last publish failed", step)
		}
	}
	healthy := func(step string) {
		t.Helper()
		if err := s.Health(); err != nil {
			t.Fatalf("%s: Health = %v, want nil", step, err)
		}
	}

	deliver("all up", nil, task("a", "k", "1"), task("b", "k", "2"))
	healthy("all up")
	if produces[downLeader].Load() == 0 || produces[upLeader].Load() == 0 {
		t.Fatalf("produces per broker %d %d %d: a is not led by broker 1 or b not by broker 2",
			produces[0].Load(), produces[1].Load(), produces[2].Load())
	}

	down.Store(true)
	deliver("a while its leader is down", map[string]bool{"a": true}, task("a", "k", "3"))
	unhealthy("a while its leader is down")
	deliver("b while a's leader is down", nil, task("b", "k", "4"))
	unhealthy("after a successful publish to b")
	// One call with both: b's record is written, a's gets no answer.
	deliver("a and b in one call", map[string]bool{"a": true}, task("a", "k", "5"), task("b", "k", "6"))
	unhealthy("after a call that wrote b and not a")

	down.Store(false)
	deliver("b after a's leader is back", nil, task("b", "k", "7"))
	unhealthy("a's leader back, but nothing published to a yet")
	deliver("a after its leader is back", nil, task("a", "k", "8"))
	healthy("after a successful publish to a")

	// From healthy, one call that writes b and not a makes the sink
	// unhealthy; one that writes both makes it healthy again.
	down.Store(true)
	deliver("a and b from healthy", map[string]bool{"a": true}, task("b", "k", "9"), task("a", "k", "10"))
	unhealthy("after a call that wrote b and not a, from healthy")
	down.Store(false)
	deliver("a and b, all up again", nil, task("b", "k", "11"), task("a", "k", "12"))
	healthy("after a call that wrote both")
}

// topicHealth.publish, driven by sequences of publish outcomes.
func TestTopicHealthPublish(t *testing.T) {
	errA := errors.New("kafka: publish: leader of a down")
	errB := errors.New("kafka: publish: leader of b down")
	type step struct {
		written []string
		err     error
		down    []string
		changed bool
		health  error // want Health
		failed  string
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"success while healthy", []step{
			{written: []string{"a", "b"}},
		}},
		{"failure then success of another topic", []step{
			{err: errA, down: []string{"a"}, changed: true, health: errA, failed: "a"},
			{written: []string{"b"}, health: errA, failed: "a"},
			{written: []string{"b", "c", "b"}, health: errA, failed: "a"},
		}},
		{"failure then success of the same topic", []step{
			{err: errA, down: []string{"a"}, changed: true, health: errA, failed: "a"},
			{written: []string{"a"}, changed: true},
		}},
		{"two topics recover one by one", []step{
			{err: errA, down: []string{"a"}, changed: true, health: errA, failed: "a"},
			{err: errB, down: []string{"b"}, changed: true, health: errB, failed: "a b"},
			// b recovers: Health names a's error, not b's.
			{written: []string{"b"}, changed: true, health: errA, failed: "a"},
			{written: []string{"b"}, health: errA, failed: "a"},
			{written: []string{"a", "b"}, changed: true},
		}},
		{"one call writes b, loses a", []step{
			{written: []string{"b"}, err: errA, down: []string{"a"}, changed: true, health: errA, failed: "a"},
		}},
		{"one call writes a failed topic and loses another", []step{
			{err: errA, down: []string{"a", "b"}, changed: true, health: errA, failed: "a b"},
			{written: []string{"a"}, err: errB, down: []string{"b"}, changed: true, health: errB, failed: "b"},
			{written: []string{"b"}, changed: true},
		}},
		// Topic granularity: a topic with one partition up and one down
		// stays failed after a call that wrote one and lost the other.
		{"partition up and partition down of one topic", []step{
			{written: []string{"a"}, err: errA, down: []string{"a"}, changed: true, health: errA, failed: "a"},
			{written: []string{"a", "b"}, err: errA, down: []string{"a"}, changed: true, health: errA, failed: "a"},
			{written: []string{"a"}, changed: true},
		}},
		// No answer while stopping is no news (err nil): a written topic
		// recovers, the others stay as they were.
		{"stopping", []step{
			{err: errA, down: []string{"a", "b"}, changed: true, health: errA, failed: "a b"},
			{written: []string{"a"}, down: []string{"a", "b"}, changed: true, health: errA, failed: "b"},
			{down: []string{"b"}, health: errA, failed: "b"},
		}},
		{"a failure without topics clears with any success", []step{
			{err: errA, changed: true, health: errA},
			{written: []string{"b"}, changed: true},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h topicHealth
			for i, st := range tc.steps {
				changed := h.publish(st.written, st.err, st.down)
				failed := strings.Join(slices.Sorted(maps.Keys(h.failed)), " ")
				if changed != st.changed || h.err != st.health || failed != st.failed {
					t.Fatalf("step %d (written %q, err %v, down %q): changed %v, Health %v, failed %q; want %v, %v, %q",
						i, st.written, st.err, st.down, changed, h.err, failed, st.changed, st.health, st.failed)
				}
				if h.err == nil && h.failed != nil {
					t.Fatalf("step %d: healthy with failed topics kept: %v", i, h.failed)
				}
			}
		})
	}
}

// A probe that started before a publish changed the failed topics does not
// count; a publish that changes nothing leaves the probe's result valid.
func TestSinkProbeEpochPartialRecovery(t *testing.T) {
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
	errA := errors.New("kafka: publish: a")
	s.setHealth(nil, errA, []string{"a", "b"})
	started := epoch()
	s.setHealth([]string{"b"}, nil, nil) // b recovered while the probe ran
	if s.probeDone(started, errors.New("b's leader refused")) {
		t.Fatal("a stale probe failure cleared Health")
	}
	if err := s.Health(); err != errA {
		t.Fatalf("Health = %v, want a's publish error kept over a stale probe", err)
	}
	started = epoch()
	s.setHealth([]string{"c"}, nil, nil) // c was never failed: no news
	if epoch() != started {
		t.Fatal("a publish that changed nothing bumped the epoch")
	}
	if !s.probeDone(started, nil) || s.Health() != nil {
		t.Fatalf("a current probe succeeded but Health = %v", s.Health())
	}
}
