package nats

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus/testutil"
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
	srv := startServer(t, opts)
	cfg := testConfig(t, serverURL(srv))
	cfg.Create = true
	cfg.PullExpiry = time.Second
	nc := connect(t, cfg)
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	js := newJS(t, nc)
	if info := consumerInfo(t, js, cfg.Stream, cfg.Consumer); info.Config.MaxRequestBatch != 100 {
		t.Fatalf("consumer max_request_batch %d, want the server's 100", info.Config.MaxRequestBatch)
	}
	rec := newRecorder()
	stop := runSource(t, src, rec)
	defer stop()
	publish(t, js, "delay.a", "m", delayHeader())
	waitReady(t, src, "the message taken in", func() bool { return rec.itemCount() == 1 })
}

// waitReady polls cond for 30 s and fails saying
// whether the source reported itself healthy meanwhile.
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

// collect cancels its idle-look context (icancel) before it asks
// whether that context ended, so every error of the iterator's Next (a
// missed heartbeat, a terminal 400/409, the iterator closed) comes back
// as errIdle. A closed iterator answers Next at once: consume spins
// between Next and a consumer info request, with no backoff, ready and
// silent, instead of restarting. Here an operator adds a priority group
// to the consumer while the bridge runs: its next pull is refused 400
// Bad Request (terminal, the iterator stops).
func TestClosedIteratorNoSpin(t *testing.T) {
	cfg, nc, js, src := createdSource(t, func(c *Config) { c.PullExpiry = time.Second })
	rec := newRecorder()
	stop := runSource(t, src, rec)
	defer stop()
	publish(t, js, "delay.a", "first", delayHeader())
	eventually(t, "first message", func() bool { return rec.itemCount() == 1 })

	var infos atomic.Int64
	sub, err := nc.Subscribe("$JS.API.CONSUMER.INFO."+cfg.Stream+"."+cfg.Consumer, func(*natsgo.Msg) { infos.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	ctx := context.Background()
	cc := consumerInfo(t, js, cfg.Stream, cfg.Consumer).Config
	cc.PriorityPolicy, cc.PriorityGroups = jetstream.PriorityPolicyOverflow, []string{"g"}
	if _, err := js.UpdateConsumer(ctx, cfg.Stream, cc); err != nil {
		t.Fatal(err)
	}
	// The iterator's pull in flight expires within a PullExpiry; the next
	// one is refused.
	time.Sleep(3 * time.Second)
	n0 := infos.Load()
	time.Sleep(2 * time.Second)
	// A restart with backoff asks a few times a second at most.
	if n := infos.Load() - n0; n > 50 {
		t.Fatalf("%d consumer info requests in 2 s: the source spins on a closed iterator (errors: %v, health: %v)",
			n, testutil.ToFloat64(cfg.Metrics.SourceErrors.WithLabelValues(cfg.Stream)), src.Health())
	}
}
