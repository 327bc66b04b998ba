package nats

import (
	"fmt"
	"testing"
	"time"
)

// A server whose JetStream limits cap a pull request's batch
// (jetstream { limits { max_request_batch: 100 } }) gives the consumer
// the bridge creates MaxRequestBatch 100. The source asks for
// 2 x BatchSize = 512 messages a pull: the server answers every pull 409
// Exceeded MaxRequestBatch, nats.go swallows it, and nothing is ever
// delivered, the source ready.
func TestServerMaxRequestBatch(t *testing.T) {
	opts := jsOptions(t)
	opts.JetStreamLimits.MaxRequestBatch = 100
	cfg, _, js, src := createdSourceOn(t, opts, nil)
	if info := consumerInfo(t, js, cfg.Stream, cfg.Consumer); info.Config.MaxRequestBatch != 100 {
		t.Fatalf("consumer max_request_batch %d, want the server's 100", info.Config.MaxRequestBatch)
	}
	rec := newRecorder()
	stop := runSource(t, src, rec)
	defer stop()
	publish(t, js, "delay.a", "m", delayHeader())
	waitReady(t, src, "the message taken in", func() bool { return rec.itemCount() == 1 })
}

// waitReady polls cond for 30 s and fails saying whether the source
// reported itself healthy meanwhile.
func waitReady(t *testing.T, src *Source, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	unready := 0
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s; the source was not ready in %d of its polls, now: %v", what, unready, src.Health())
		}
		if src.Health() != nil {
			unready++
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestConsumerMaxRequestBatchLowered: an operator lowers the consumer's
// max_request_batch below the source's pulls while it runs. The server
// refuses the next pull (409 Exceeded MaxRequestBatch); the source starts
// consuming over, reads the consumer's limits again and pulls within
// them, rather than waiting on a pull that never comes.
func TestConsumerMaxRequestBatchLowered(t *testing.T) {
	cfg, _, js, src := createdSource(t, func(c *Config) { c.BatchSize = 8 }) // pulls of 16
	rec := newRecorder()
	stop := runSource(t, src, rec)
	defer stop()
	publish(t, js, "delay.a", "first", delayHeader())
	waitReady(t, src, "the first message", func() bool { return rec.itemCount() == 1 })
	cc := consumerInfo(t, js, cfg.Stream, cfg.Consumer).Config
	cc.MaxRequestBatch = 4
	if _, err := js.UpdateConsumer(ctxT(t), cfg.Stream, cc); err != nil {
		t.Fatal(err)
	}
	const n = 40
	for i := range n {
		publish(t, js, "delay.a", fmt.Sprint("m", i), delayHeader())
	}
	waitReady(t, src, fmt.Sprintf("%d more messages", n), func() bool { return rec.itemCount() == 1+n })
}
