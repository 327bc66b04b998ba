package kafka

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/logthrottle"
)

// TestCommitFailLogThrottledAcrossPorts (review R210): "offset commit
// failed" was throttled by its error's text, and a connection reset
// names the client's ephemeral port, new at each connection: every retry
// logged its own line. Keyed by the error's shape: one line.
func TestCommitFailLogThrottledAcrossPorts(t *testing.T) {
	var errs []error
	for i := range 10 {
		errs = append(errs, fmt.Errorf("write tcp 127.0.0.1:%d->127.0.0.1:9092: write: connection reset by peer", 40000+i))
	}
	l := &commitLog{errs: errs}
	core, logs := observer.New(zap.InfoLevel)
	c := newCommitter(l.commit, 100*time.Millisecond, 5*time.Second, zap.New(core), func(string) {})
	now := time.Unix(1_000_000, 0)
	c.now = func() time.Time { return now }
	c.offer("a", 0, 5)
	for range 10 {
		now = now.Add(time.Second)
		c.flush()
	}
	if n := logs.FilterMessage("offset commit failed; retrying").Len(); n != 1 {
		t.Fatalf("10 commits reset in 10 s, each naming its own port: %d lines, want 1", n)
	}
	now = now.Add(time.Second)
	c.flush()
	if n := logs.FilterMessage("offset commit succeeded again").Len(); n != 1 {
		t.Fatalf("the commit after them: %d end lines, want 1", n)
	}
}

// TestCommitFlappingThrottled (review R210): "offset commit succeeded
// again" was logged after any failed commit, a held-back one too, and
// restarted the failure throttle: commits failing and succeeding by turns
// (a coordinator flapping) logged two lines a turn. Now a failure line
// is followed by one end line, and the turns within the interval after
// it log nothing.
func TestCommitFlappingThrottled(t *testing.T) {
	const turns = 100
	l := &commitLog{}
	core, logs := observer.New(zap.InfoLevel)
	c := newCommitter(l.commit, 100*time.Millisecond, 5*time.Second, zap.New(core), func(string) {})
	now := time.Unix(1_000_000, 0)
	c.now = func() time.Time { return now }
	for i := range turns {
		l.mu.Lock()
		l.errs = []error{fmt.Errorf("read tcp 127.0.0.1:%d->127.0.0.1:9092: i/o timeout", 40000+i)}
		l.mu.Unlock()
		c.offer("a", 0, int64(i+1))
		c.flush() // fails
		now = now.Add(50 * time.Millisecond)
		c.flush() // succeeds
		now = now.Add(50 * time.Millisecond)
	}
	fails := logs.FilterMessage("offset commit failed; retrying").Len()
	ends := logs.FilterMessage("offset commit succeeded again").Len()
	if fails != 1 || ends != 1 {
		t.Fatalf("%d turns of a failed and a good commit in %v: %d failure and %d end lines, want 1 and 1", turns, turns*100*time.Millisecond, fails, ends)
	}
	if last := logs.All()[logs.Len()-1]; last.Message != "offset commit succeeded again" {
		t.Fatalf("the last line %q, want the end line after the failure line", last.Message)
	}
	// The ends held back are said by the first good commit after their
	// interval (review R212: else they showed nowhere): every turn's end
	// is counted once.
	now = now.Add(logthrottle.DefaultEvery)
	c.offer("a", 0, turns+1)
	c.flush()
	shown := 0
	for _, e := range logs.FilterMessage("offset commit succeeded again").All() {
		held, _ := e.ContextMap()["held_back"].(int64)
		shown += 1 + int(held)
	}
	if shown != turns {
		t.Fatalf("%d turns' ends shown as %d after the interval", turns, shown)
	}
}

// TestCommitEndAfterRebalance (review R212): the offset commits' lines
// were a generation's committer's: a coordinator failing the commits
// (restarting, moving) ends the generation too, and the next
// generation's committer, which had seen no failure, stored its commits
// without a line: the log's last word on the commits stayed "offset
// commit failed". The end line comes in the next generation, and a
// rebalance loop failing the same way is throttled across generations.
func TestCommitEndAfterRebalance(t *testing.T) {
	s, err := NewSource(testConfig(t, []string{"127.0.0.1:1"}, "g", "delay"))
	if err != nil {
		t.Fatal(err)
	}
	core, logs := observer.New(zap.InfoLevel)
	now := time.Unix(1_000_000, 0)
	gen := func(l *commitLog) *committer {
		c := s.newGenCommitter(l.commit, zap.New(core))
		c.now = func() time.Time { return now }
		return c
	}
	errCoord := errors.New("kafka: commit offsets: [15] Group Coordinator Not Available: the coordinator is not available")
	fails := func() int { return logs.FilterMessage("offset commit failed; retrying").Len() }
	ends := func() int { return logs.FilterMessage("offset commit succeeded again").Len() }

	c1 := gen(&commitLog{errs: []error{errCoord}})
	c1.offer("delay", 0, 5)
	c1.flush() // fails, logged; the generation ends with it
	c2 := gen(&commitLog{})
	now = now.Add(time.Second)
	c2.offer("delay", 0, 7)
	c2.flush()
	if fails() != 1 || ends() != 1 {
		t.Fatalf("a failed commit, a rebalance, a good commit: %d failure and %d end lines, want 1 and 1", fails(), ends())
	}
	for i := range 5 { // a rebalance loop, each generation failing alike
		now = now.Add(time.Second)
		c := gen(&commitLog{errs: []error{errCoord}})
		c.offer("delay", 0, int64(8+i))
		c.flush()
	}
	if fails() != 1 {
		t.Fatalf("5 generations failing their commits alike within 5 s: %d failure lines, want 1 (then one per 30 s)", fails())
	}
}
