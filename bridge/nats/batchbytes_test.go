package nats

import (
	"context"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
)

// TestSourceBatchBytesBounded: a backlog of large messages is handed to
// the bridge in batches of about BatchBytes, not BatchSize messages, and
// every message arrives once.
func TestSourceBatchBytesBounded(t *testing.T) {
	const (
		n          = 120
		size       = 128 << 10
		batchBytes = 1 << 20
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
