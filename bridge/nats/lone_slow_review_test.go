package nats

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// TestLoneSlowStreamPerKeySubjects (review R190): a stream that
// answers late but works (every PubAck 1.5 s late, PublishTimeout 5 s)
// and captures one subject per key (slow.<key>), delivered in batches of
// one while another lane delivers to a fast stream. Each lone publish is
// cut 1 s after the other lane's PubAck; its PubAck comes after all and
// marks only its own subject slow (slowOK is per subject), so the next
// key of the same stream is cut again: every task of such a stream is
// retried as an outage while other lanes are busy. Before 6c10f3b none
// was cut (a batch without a PubAck of its own was never cut). Now a lone
// publish is cut by another lane's PubAck only if a stream acknowledged
// its subject before, and a late PubAck marks its stream slow too.
func TestLoneSlowStreamPerKeySubjects(t *testing.T) {
	cfg, nc, js, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 5 * time.Second })
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OK", Subjects: []string{"ok.>"}}); err != nil {
		t.Fatal(err)
	}
	sink := newSink(t, nc, cfg)
	taken := make(chan struct{}, 8)
	seq := 0
	sub, err := nc.Subscribe("slow.>", func(m *natsgo.Msg) {
		seq++
		n := seq
		taken <- struct{}{}
		go func() {
			time.Sleep(1500 * time.Millisecond)
			_ = m.Respond(fmt.Appendf(nil, `{"stream":"SLOW","seq":%d}`, n))
		}()
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	cut := 0
	for k := 1; k <= 3; k++ {
		subject := fmt.Sprintf("slow.%d", k)
		sink.setVerdict(subject, false) // a stream subject, no probe
		ch := make(chan []error, 1)
		go func() {
			ch <- sink.Deliver(ctxT(t), []*codec.Task{task(fmt.Sprintf("s%d", k), subject, "s", 1)})
		}()
		<-taken // its publish is out
		if errs := sink.Deliver(ctxT(t), []*codec.Task{task(fmt.Sprintf("h%d", k), "ok.a", "h", 1)}); errs != nil {
			t.Fatalf("healthy batch: %v", errs)
		}
		errs := <-ch
		t.Logf("%s: %v", subject, errs)
		if errs != nil {
			if !errors.Is(errs[0], shard.ErrUnavailable) {
				t.Fatalf("%s: %v", subject, errs)
			}
			cut++
			// The late PubAck marks the subject slow.
			eventually(t, subject+" noted slow", func() bool { return sink.slowSubject(subject) })
		}
	}
	if cut > 1 {
		t.Errorf("%d of 3 lone publishes to one slow-but-working stream (PubAck after 1.5 s, PublishTimeout %v) were cut as outages; at most the first should be", cut, cfg.PublishTimeout)
	}
}

// TestLoneStragglerNotCutByAnOlderPubAck (review R190): a lone publish
// is cut only by a PubAck seen after it was sent. Sink.lastAck was wall
// clock (UnixNano), so one seen just before a step back of the wall clock
// read as later than a publish sent after the step, and the lone publish
// of a slow cluster was cut (1.70 s for a 700 ms step, PublishTimeout 4
// s). It is now kept on the monotonic clock (ns since the sink's epoch),
// which no step moves: a PubAck seen before the send, here 700 ms before,
// cuts nothing.
func TestLoneStragglerNotCutByAnOlderPubAck(t *testing.T) {
	cfg, nc, _, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 4 * time.Second })
	sink := newSink(t, nc, cfg)
	stuckSubject(t, nc, sink, "tq.a")
	sink.mu.Lock()
	sink.noteStreamLocked("tq.a", "TQ") // acknowledged before: a lone publish may be cut
	sink.mu.Unlock()
	sink.ping = func(context.Context) bool { return false } // a slow cluster: no other answer either
	sink.lastAck.Store(int64(time.Since(sink.epoch) - 700*time.Millisecond))
	began := time.Now()
	errs := sink.Deliver(ctxT(t), []*codec.Task{task("q", "tq.a", "q", 1)})
	took := time.Since(began)
	t.Logf("%v: %v", took, errs)
	if took < cfg.PublishTimeout {
		t.Errorf("a lone straggler with nothing acknowledged since it was sent was cut after %v (PublishTimeout %v)", took, cfg.PublishTimeout)
	}
}

// TestSlowMarkedPerStream (review R191): a late PubAck marks the stream
// that gave it slow, not each subject, when the stream is known: a stream
// with a subject per key takes one entry of slowOK however many keys are
// late, so the marks are not cleared at maxNoted (which made the stream
// cut once more every ~1000 late keys), and every key known to be the
// stream's is slow with it.
func TestSlowMarkedPerStream(t *testing.T) {
	cfg, nc, _, _ := createdSource(t, nil)
	sink := newSink(t, nc, cfg)
	n := 2 * maxNoted
	for k := range n {
		sink.noteSlow(fmt.Sprintf("slow.%d", k), "SLOW")
	}
	sink.mu.Lock()
	entries := len(sink.slowOK)
	sink.mu.Unlock()
	if entries != 1 {
		t.Errorf("%d slowOK entries after %d late keys of one stream, want 1", entries, n)
	}
	for _, k := range []int{0, n / 2, n - 1} {
		if subject := fmt.Sprintf("slow.%d", k); !sink.slowSubject(subject) {
			t.Errorf("%s not slow", subject)
		}
	}
	// A subject whose stream is not known is noted as itself.
	sink.noteSlow("alone.a", "")
	if !sink.slowSubject("alone.a") || sink.slowSubject("alone.b") {
		t.Errorf("alone.a slow %v, alone.b slow %v; want true, false", sink.slowSubject("alone.a"), sink.slowSubject("alone.b"))
	}
}
