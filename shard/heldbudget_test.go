package shard

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestHeldNotStarvedByByteBudget: 10 NATS tasks are held on disk
// (their broker was down). It is back. Meanwhile a Kafka backlog of
// large tasks is due in the wheel. The loop's claim puts the held tasks
// last ("at least half of a batch, so neither they nor the due ones
// starve"), so readClaimed's byte budget always sends them back: every
// round claims them (moving the release cursor past them) and returns
// them unread, and none is delivered until the whole Kafka backlog is,
// though the NATS lane is idle all the while. Before fire_batch_bytes
// they went in every round beside the due ones.
func TestHeldNotStarvedByByteBudget(t *testing.T) {
	const big = 4 << 10
	budget := 2 * (big + 200)
	h := holdHarness(t, -1, func(o *Options) { o.FireBatchBytes = budget })
	var held []codec.Task
	for i := range 10 {
		n := sched(fmt.Sprintf("n%03d", i), t0.Add(time.Second), int64(1000+i))
		n.Transport, n.Target = codec.TransportNATS, "subj"
		held = append(held, n)
	}
	holdTasks(t, h, held, 10)
	h.sink.reset()
	h.sink.setFail(nil)
	// A backlog of large Kafka tasks, due now, ingested while the NATS
	// group still waits out its backoff, then the backoff passes.
	var batch []codec.Task
	for i := range 120 {
		k := sched(fmt.Sprintf("k%03d", i), h.clk.Now().Add(time.Second), int64(i+1))
		k.Value = []byte(strings.Repeat("v", big))
		batch = append(batch, k)
	}
	h.stop()
	h.ingest(batch)
	h.clk.Advance(10 * time.Second) // the backoff over, the backlog due
	h.run()
	h.settle()
	acked := h.sink.acked()
	first := -1
	for i, id := range acked {
		if id[0] == 'n' {
			first = i
			break
		}
	}
	t.Logf("%d delivered; first held NATS task at position %d", len(acked), first)
	if len(acked) != 130 {
		t.Fatalf("%d delivered, want 130", len(acked))
	}
	// A round delivers one or two Kafka tasks, and the held tasks are
	// claimed in any round their lane is free: they come among the first
	// rounds' deliveries (usually within the first 8; 17 was seen under
	// -race with the lanes' goroutines scheduled late), not after the
	// whole Kafka backlog as when the due tasks spent the budget.
	if first > 60 {
		t.Errorf("the first held NATS task was delivered after %d Kafka tasks: held tasks claimed every round and sent back by the byte budget", first)
	}
	h.checkPending()
}
