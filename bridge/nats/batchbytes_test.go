package nats

import (
	"context"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
)

// TestSourceBatchBytesBounded: a backlog of large messages is taken in
// batches of about BatchBytes, not BatchSize messages, and the pull
// requests are bounded in bytes too: what the server has delivered and
// the bridge not yet acked stays a few MiB, where 2 x BatchSize
// prefetched messages of 128 KiB were 64 MiB (all 15 MiB here). Every message still
// arrives once.
func TestSourceBatchBytesBounded(t *testing.T) {
	const (
		n          = 120
		size       = 128 << 10
		batchBytes = 1 << 20
		bound      = 12 << 20 // the default pull limit (4 MiB) twice, a batch in hand, slack
	)
	_, _, js, src := createdSource(t, func(c *Config) { c.AckWait = time.Hour; c.BatchBytes = batchBytes })
	body := strings.Repeat("x", size)
	for i := range n {
		h := natsgo.Header{}
		h.Set("delay-after", "1h")
		h.Set("delay-target", "out")
		if _, err := js.PublishMsg(context.Background(), &natsgo.Msg{Subject: "delay.a", Data: []byte(body), Header: h}); err != nil {
			t.Fatalf("publish %d: %v", i, err)
		}
	}
	first := &blocker{recorder: newRecorder(), entered: make(chan struct{}), release: make(chan struct{})}
	stop := runSource(t, src, first)
	<-first.entered
	// While the first batch is held, the server may deliver what the
	// open pull requests ask for and no more. Watched for a while: with
	// no byte bound it went over at once.
	for range 25 {
		if held := consumerInfo(t, js, "DELAY", "bridge").NumAckPending; held*size > bound {
			t.Fatalf("%d messages of %d KiB delivered and not acked (%d MiB) while one batch is handled; bound %d MiB", held, size>>10, held*size>>20, bound>>20)
		}
		time.Sleep(20 * time.Millisecond)
	}
	close(first.release)
	deadline := time.Now().Add(20 * time.Second)
	count := func() int {
		first.mu.Lock()
		defer first.mu.Unlock()
		return len(first.items)
	}
	for count() < n && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if got := count(); got != n {
		t.Fatalf("%d messages handed over, want %d", got, n)
	}
	first.mu.Lock()
	defer first.mu.Unlock()
	for _, b := range first.batches {
		if len(b.Items) > 0 && (len(b.Items)-1)*size >= batchBytes {
			t.Fatalf("a batch of %d messages of %d KiB: it should end once it reaches %d KiB", len(b.Items), size>>10, batchBytes>>10)
		}
	}
}

func TestPullBytes(t *testing.T) {
	for _, tc := range []struct {
		batch      int
		maxPayload int64
		want       int
	}{
		{4 << 20, 1 << 20, 4 << 20},
		{1 << 20, 1 << 20, 1<<20 + pullFraming},
		{1 << 20, 8 << 20, 8<<20 + pullFraming},
		{1 << 20, 0, 1 << 20},
		{1 << 20, 1 << 62, 1<<40 + pullFraming},
	} {
		if got := pullBytes(tc.batch, tc.maxPayload); got != tc.want {
			t.Errorf("pullBytes(%d, %d) = %d, want %d", tc.batch, tc.maxPayload, got, tc.want)
		}
	}
}
