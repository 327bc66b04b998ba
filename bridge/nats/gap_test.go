package nats

import (
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestSourceGapBeforeRedelivery: another instance sharing the consumer
// takes the first deliveries of 3 and 4, gives 3 back (a nak) and keeps 4.
// This source then sees a gap in delivery sequences followed by a
// redelivery (of 3), handles 5 and 6, and the server's ack floor reaches 3
// while 4 is held elsewhere. The floor must not pass 4: when 4 comes back
// (its holder gave up) it must be handed over, not acked as already held.
// AckWait is a minute, so every redelivery here is a nak's.
func TestSourceGapBeforeRedelivery(t *testing.T) {
	_, _, js, src := createdSource(t, func(c *Config) { c.AckWait, c.BatchSize, c.Linger = time.Minute, 1, time.Millisecond })
	h := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	runSource(t, src, h)
	publish(t, js, "delay.a", "1", nil)
	publish(t, js, "delay.a", "2", nil)
	select {
	case <-h.entered: // 1 in the handler, 2 in the source's buffer: it pulls no more
	case <-time.After(15 * time.Second):
		t.Fatal("the first batch never reached the handler")
	}
	publish(t, js, "delay.a", "3", nil)
	publish(t, js, "delay.a", "4", nil)
	cons, err := js.Consumer(ctxT(t), "DELAY", "bridge")
	if err != nil {
		t.Fatal(err)
	}
	mb, err := cons.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var other []jetstream.Msg
	for m := range mb.Messages() {
		other = append(other, m)
	}
	seqOf := func(m jetstream.Msg) uint64 {
		md, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		return md.Sequence.Stream
	}
	if len(other) != 2 || seqOf(other[0]) != 3 || seqOf(other[1]) != 4 {
		t.Fatalf("the other instance fetched %d messages, want the first deliveries of 3 and 4", len(other))
	}
	if err := other[0].Nak(); err != nil {
		t.Fatal(err)
	}
	close(h.release)
	eventually(t, "3 redelivered to the source", func() bool { return slices.Contains(h.seqs(), 3) })
	publish(t, js, "delay.a", "5", nil)
	eventually(t, "5", func() bool { return slices.Contains(h.seqs(), 5) })
	eventually(t, "ack floor 3", func() bool { return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream >= 3 })
	// The source reads the ack floor after a batch, at most every
	// barrierCheckEvery: the batch of 6 reads it with 3 acked, 4 not.
	time.Sleep(barrierCheckEvery + 100*time.Millisecond)
	publish(t, js, "delay.a", "6", nil)
	eventually(t, "6", func() bool { return slices.Contains(h.seqs(), 6) })
	if err := other[1].Nak(); err != nil { // the holder of 4 gives it back
		t.Fatal(err)
	}
	eventually(t, "4 handed over after it came back", func() bool { return slices.Contains(h.seqs(), 4) })
	eventually(t, "everything acked", func() bool { return consumerInfo(t, js, "DELAY", "bridge").AckFloor.Stream >= 6 })
	if got := h.seqs(); !slices.Equal(slices.Sorted(slices.Values(got)), []int64{1, 2, 3, 4, 5, 6}) {
		t.Fatalf("handled %v, want 1-6 once each", got)
	}
}
