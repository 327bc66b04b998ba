package nats

import (
	"fmt"
	"sync"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"

	"github.com/delaybridge/delaybridge/codec"
)

// ackingSubject makes subject look like a stream's: a subscriber that
// answers the first atOnce publishes with a PubAck from stream at once
// and the others after hold (a leader whose disk stalls for a moment, a
// stream farther away), and a stream verdict so no probe.
func ackingSubject(t *testing.T, nc *natsgo.Conn, sink *Sink, subject, stream string, atOnce int, hold time.Duration) {
	t.Helper()
	var mu sync.Mutex
	seq := 0
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	onSubject(t, nc, sink, subject, func(m *natsgo.Msg) {
		mu.Lock()
		seq++
		n := seq
		mu.Unlock()
		ack := []byte(fmt.Sprintf(`{"stream":%q,"seq":%d}`, stream, n))
		if n <= atOnce {
			_ = m.Respond(ack)
			return
		}
		wg.Add(1)
		time.AfterFunc(hold, func() { defer wg.Done(); _ = m.Respond(ack) })
	})
}

// TestBurstyStreamNotCut (review R186): a stream acknowledges 2 of a
// batch's 6 publishes at once and the other 4 800 ms later, well within
// PublishTimeout. Every publish is acknowledged; none should fail.
func TestBurstyStreamNotCut(t *testing.T) {
	cfg, nc, _, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 5 * time.Second })
	sink := newSink(t, nc, cfg)
	ackingSubject(t, nc, sink, "tburst.a", "BURST", 2, 800*time.Millisecond)
	var batch []*codec.Task
	for i := range 6 {
		batch = append(batch, task(fmt.Sprintf("b%d", i), "tburst.a", "b", 1))
	}
	began := time.Now()
	errs := sink.Deliver(ctxT(t), batch)
	t.Logf("took %v", time.Since(began))
	for i, err := range errs {
		if err != nil {
			t.Errorf("task %d of a stream that acknowledged it within PublishTimeout: %v", i, err)
		}
	}
}

// TestFastErrorsStartNoGrace (review R186): answers that carry no
// stream's pace (no responders for a subject without a stream) do not
// start the stragglers' grace: a stream whose PubAcks all come 1.5 s
// late, in a batch with such a subject, is waited for, not cut.
func TestFastErrorsStartNoGrace(t *testing.T) {
	cfg, nc, _, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 5 * time.Second })
	sink := newSink(t, nc, cfg)
	ackingSubject(t, nc, sink, "tlate.a", "LATE", 0, 1500*time.Millisecond)
	batch := []*codec.Task{task("n", "nostream.a", "n", 1)}
	for i := range 3 {
		batch = append(batch, task(fmt.Sprintf("l%d", i), "tlate.a", "l", 1))
	}
	began := time.Now()
	errs := sink.Deliver(ctxT(t), batch)
	t.Logf("took %v: %v", time.Since(began), errs)
	if errs == nil || errs[0] == nil {
		t.Fatalf("errs %v, want the task for a subject without a stream failed", errs)
	}
	for i, err := range errs[1:] {
		if err != nil {
			t.Errorf("task %d of a stream that acknowledged it within PublishTimeout: %v", i, err)
		}
	}
}

// TestStreamHeardThroughAnotherSubject (review R188): a stream capturing
// two subjects answers one of them at once and the other 1.5 s later (its
// answers come in bursts). The second subject answered nothing in the
// batch, but its stream did (the sink knows the subject's stream from an
// earlier PubAck): it is waited for, not cut.
func TestStreamHeardThroughAnotherSubject(t *testing.T) {
	cfg, nc, _, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 5 * time.Second })
	sink := newSink(t, nc, cfg)
	ackingSubject(t, nc, sink, "tmulti.fast", "MULTI", 0, 0)
	ackingSubject(t, nc, sink, "tmulti.slow", "MULTI", 0, 1500*time.Millisecond)
	// An earlier delivery tells the sink tmulti.slow's stream.
	if errs := sink.Deliver(ctxT(t), []*codec.Task{task("w", "tmulti.slow", "w", 1)}); errs != nil {
		t.Fatalf("warm-up: %v", errs)
	}
	batch := []*codec.Task{task("s", "tmulti.slow", "s", 1), task("f", "tmulti.fast", "f", 1)}
	began := time.Now()
	errs := sink.Deliver(ctxT(t), batch)
	t.Logf("took %v: %v", time.Since(began), errs)
	for i, err := range errs {
		if err != nil {
			t.Errorf("task %d of a stream that acknowledged it within PublishTimeout: %v", i, err)
		}
	}
}
