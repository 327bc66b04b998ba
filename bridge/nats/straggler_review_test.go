package nats

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// stuckSubject makes subject look like a stream that takes publishes and
// never acknowledges them (a quorum-lost leader): a subscriber that does
// not answer, and a stream verdict so no probe.
func stuckSubject(t *testing.T, nc *natsgo.Conn, sink *Sink, subject string) {
	t.Helper()
	onSubject(t, nc, sink, subject, func(*natsgo.Msg) {})
}

// onSubject subscribes h to subject for the test and gives the sink a
// stream verdict for it (no probe).
func onSubject(t *testing.T, nc *natsgo.Conn, sink *Sink, subject string, h natsgo.MsgHandler) {
	t.Helper()
	sub, err := nc.Subscribe(subject, h)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	sink.setVerdict(subject, false)
}

// TestStragglersOfStuckStreams (review R185): 1, 2 and 5 tasks of the
// batch for a stream that never acknowledges, then 2 + 2 for two such
// streams, among 4 healthy ones. The rule before cut a straggler only once
// every other publish had its answer, so two or more were never cut and
// the healthy tasks waited the whole PublishTimeout. Now every one is cut
// after the grace that follows the batch's last answer.
func TestStragglersOfStuckStreams(t *testing.T) {
	cfg, nc, js, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 3 * time.Second })
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OK", Subjects: []string{"ok.>"}}); err != nil {
		t.Fatal(err)
	}
	sink := newSink(t, nc, cfg)
	stuckSubject(t, nc, sink, "tq.a")
	stuckSubject(t, nc, sink, "tq.b")
	for _, tc := range []struct{ a, b int }{{1, 0}, {2, 0}, {5, 0}, {2, 2}} {
		var batch []*codec.Task
		// Stuck ones first, so the healthy answers come after they are out.
		for i := range tc.a {
			batch = append(batch, task(fmt.Sprintf("qa%d-%d-%d", tc.a, tc.b, i), "tq.a", "q", 1))
		}
		for i := range tc.b {
			batch = append(batch, task(fmt.Sprintf("qb%d-%d-%d", tc.a, tc.b, i), "tq.b", "q", 1))
		}
		stuck := tc.a + tc.b
		for i := range 4 {
			batch = append(batch, task(fmt.Sprintf("h%d-%d-%d", tc.a, tc.b, i), "ok.a", "h", 1))
		}
		began := time.Now()
		errs := sink.Deliver(ctxT(t), batch)
		took := time.Since(began)
		t.Logf("%d + %d stragglers + 4 healthy: %v", tc.a, tc.b, took)
		if errs == nil {
			t.Fatalf("%d + %d stragglers: every publish acknowledged", tc.a, tc.b)
		}
		for i := range stuck {
			if !errors.Is(errs[i], shard.ErrUnavailable) || !errors.Is(errs[i], ErrPublishTimeout) {
				t.Errorf("straggler %d of %d + %d: %v, want a PubAck timeout (unavailable)", i, tc.a, tc.b, errs[i])
			}
		}
		for i, err := range errs[stuck:] {
			if err != nil {
				t.Errorf("healthy task %d: %v", i, err)
			}
		}
		if took >= cfg.PublishTimeout {
			t.Errorf("%d + %d stragglers: the batch took %v (PublishTimeout %v): the healthy tasks waited the whole timeout", tc.a, tc.b, took, cfg.PublishTimeout)
		}
	}
}

// TestReviewWatchCutEndsAfterClose: a cut publish's watcher ends even if
// the connection closes before the PubAck timeout: nats.go does not fail
// pending futures on CLOSED, but the ack timer (WithPublishAsyncTimeout)
// still answers the future's Err. A passing check, not a repro.
func TestReviewWatchCutEndsAfterClose(t *testing.T) {
	cfg, nc, js, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 2 * time.Second })
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OK", Subjects: []string{"ok.>"}}); err != nil {
		t.Fatal(err)
	}
	// Those of the tests before it are gone within their PublishTimeout.
	eventually(t, "no watchCut goroutine", func() bool { return watchers() == 0 })
	nc2 := connect(t, cfg)
	sink := newSink(t, nc2, cfg)
	stuckSubject(t, nc, sink, "tq.a")
	errs := sink.Deliver(ctxT(t), []*codec.Task{task("q", "tq.a", "q", 1), task("h", "ok.a", "h", 1)})
	if errs == nil || errs[1] != nil || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("errs %v", errs)
	}
	// Started by Deliver, it may not have run yet.
	eventually(t, "one watchCut goroutine", func() bool { return watchers() == 1 })
	nc2.Close()
	eventually(t, "watchCut ends", func() bool { return watchers() == 0 })
}

func watchers() int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	return strings.Count(string(buf), ").watchCut(")
}

// TestStragglerWhileWindowFull (review R185): PublishWindow smaller than
// the batch, the stuck publish first: it is waited for while the window
// is full, before the rest of the batch is out. It used to be never cut
// there, the healthy tasks after it not even published before
// PublishTimeout; now it is cut after the grace that follows the answer
// to the other publish of the window, and the rest goes out.
func TestStragglerWhileWindowFull(t *testing.T) {
	cfg, nc, js, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 3 * time.Second; c.PublishWindow = 2 })
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OK", Subjects: []string{"ok.>"}}); err != nil {
		t.Fatal(err)
	}
	sink := newSink(t, nc, cfg)
	stuckSubject(t, nc, sink, "tq.a")
	batch := []*codec.Task{task("q", "tq.a", "q", 1)}
	for i := range 4 {
		batch = append(batch, task(fmt.Sprintf("h%d", i), "ok.a", "h", 1))
	}
	began := time.Now()
	errs := sink.Deliver(ctxT(t), batch)
	took := time.Since(began)
	t.Logf("window 2, straggler first + 4 healthy: %v, %v", took, errs)
	if errs == nil || !errors.Is(errs[0], ErrPublishTimeout) {
		t.Fatalf("errs %v, want the straggler's PubAck timeout", errs)
	}
	for i, err := range errs[1:] {
		if err != nil {
			t.Errorf("healthy task %d: %v", i, err)
		}
	}
	if took >= cfg.PublishTimeout {
		t.Errorf("the batch took %v (PublishTimeout %v)", took, cfg.PublishTimeout)
	}
}

// TestReviewProbeCut: a probe (subject of unknown kind) to a stream that
// never acknowledges (no_ack) is not cut within its probe wait; once the
// lookup finds its stream, its second wait is cut after the grace like
// any straggler, and the cut still counts as the no_ack stream's (an
// attempt), not as an outage.
func TestReviewProbeCut(t *testing.T) {
	cfg, nc, js, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 8 * time.Second })
	for _, sc := range []jetstream.StreamConfig{{Name: "OK", Subjects: []string{"ok.>"}}, {Name: "NA", Subjects: []string{"na.>"}, NoAck: true}} {
		if _, err := js.CreateStream(ctxT(t), sc); err != nil {
			t.Fatal(err)
		}
	}
	sink := newSink(t, nc, cfg)
	sink.setVerdict("ok.a", false)
	began := time.Now()
	errs := sink.Deliver(ctxT(t), []*codec.Task{task("p", "na.a", "p", 1), task("h", "ok.a", "h", 1)})
	took := time.Since(began)
	t.Logf("probe to a no_ack stream + 1 healthy: %v, %v", took, errs)
	if errs == nil || errs[1] != nil {
		t.Fatalf("errs %v, want the probe failed, the healthy task delivered", errs)
	}
	if errors.Is(errs[0], shard.ErrUnavailable) || !strings.Contains(errs[0].Error(), "no_ack") {
		t.Errorf("probe: %v, want the no_ack failure (an attempt), not an outage", errs[0])
	}
	if took < sink.probeWait || took >= cfg.PublishTimeout {
		t.Errorf("the probe's batch took %v, want between the probe wait %v and PublishTimeout %v", took, sink.probeWait, cfg.PublishTimeout)
	}
}

// TestReviewDeniedStragglerCut: a subject the bridge's user may not
// publish to, known to have a stream (no probe), in a batch with a
// permitted one: its publish is cut after the grace and still fails as
// denied (an attempt), not as an outage.
func TestReviewDeniedStragglerCut(t *testing.T) {
	cfg := deniedSecretConfig(t)
	cfg.PublishTimeout = 5 * time.Second
	sink := newSink(t, connect(t, cfg), cfg)
	sink.setVerdict("secret.x", false)
	sink.setVerdict("open.y", false)
	began := time.Now()
	errs := sink.Deliver(ctxT(t), []*codec.Task{task("x", "secret.x", "v", 0), task("y", "open.y", "v", 0)})
	took := time.Since(began)
	t.Logf("%v: %v", took, errs)
	if errs == nil || errs[1] != nil {
		t.Fatalf("errs %v", errs)
	}
	if errors.Is(errs[0], shard.ErrUnavailable) || !errors.Is(errs[0], natsgo.ErrPermissionViolation) {
		t.Errorf("%v, want the cut classified as a permissions failure", errs[0])
	}
	if took >= cfg.PublishTimeout {
		t.Errorf("took %v: not cut", took)
	}
}

// TestLoneStragglerCutWhenOthersAnswer: a fire batch of one task for a
// stream that does not acknowledge has no PubAck of its own to go by; a
// PubAck another lane's batch got since it was sent shows the servers
// answer. It is cut 1 s (stragglerGraceMin) after that PubAck, instead of
// holding its lane, and the healthy tasks due behind it, for the whole
// PublishTimeout (the end-to-end quorum-loss run waited 6-9 s per such
// batch, TestOneNATSStreamDownAmongHealthy/r3-quorum-lost). Alone, with
// nothing else answered since, it still waits PublishTimeout. Only a
// subject a stream acknowledged before is so cut.
func TestLoneStragglerCutWhenOthersAnswer(t *testing.T) {
	cfg, nc, js, _ := createdSource(t, func(c *Config) { c.PublishTimeout = 4 * time.Second })
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OK", Subjects: []string{"ok.>"}}); err != nil {
		t.Fatal(err)
	}
	sink := newSink(t, nc, cfg)
	// The stuck stream: takes each publish (signalled), answers none.
	taken := make(chan struct{}, 4)
	onSubject(t, nc, sink, "tq.a", func(*natsgo.Msg) { taken <- struct{}{} })
	sink.setVerdict("ok.a", false)
	// Its stream acknowledged it before it got stuck (a subject never
	// acknowledged is not cut by another lane's PubAck, review R190).
	sink.mu.Lock()
	sink.noteStreamLocked("tq.a", "TQ")
	sink.mu.Unlock()

	type result struct {
		errs []error
		took time.Duration
	}
	lone := func() <-chan result {
		ch := make(chan result, 1)
		go func() {
			began := time.Now()
			errs := sink.Deliver(ctxT(t), []*codec.Task{task(fmt.Sprintf("q%d", time.Now().UnixNano()), "tq.a", "q", 1)})
			ch <- result{errs, time.Since(began)}
		}()
		return ch
	}

	// Alone in a slow cluster: nothing answers meanwhile, not even the
	// JetStream API.
	ping := sink.ping
	sink.ping = func(context.Context) bool { return false }
	r := <-lone()
	<-taken
	t.Logf("alone, nothing answering: %v, %v", r.took, r.errs)
	if r.errs == nil || !errors.Is(r.errs[0], shard.ErrUnavailable) {
		t.Fatalf("alone: %v, want an ErrUnavailable", r.errs)
	}
	if r.took < cfg.PublishTimeout {
		t.Errorf("a lone straggler with nothing else answered was cut after %v (PublishTimeout %v)", r.took, cfg.PublishTimeout)
	}

	// Alone, the JetStream API answering its ping (after the least
	// grace): cut the least grace after that answer.
	sink.ping = ping
	r = <-lone()
	<-taken
	t.Logf("alone, the JetStream API answering: %v, %v", r.took, r.errs)
	if r.errs == nil || !errors.Is(r.errs[0], ErrPublishTimeout) || !errors.Is(r.errs[0], shard.ErrUnavailable) {
		t.Fatalf("alone, the API answering: %v, want a PubAck timeout (unavailable)", r.errs)
	}
	if r.took >= cfg.PublishTimeout {
		t.Errorf("a lone straggler waited %v (PublishTimeout %v) although the JetStream API answered", r.took, cfg.PublishTimeout)
	}

	// Beside another lane's batch that is acknowledged.
	ch := lone()
	<-taken // its publish is out first
	if errs := sink.Deliver(ctxT(t), []*codec.Task{task("h", "ok.a", "h", 1)}); errs != nil {
		t.Fatalf("healthy batch: %v", errs)
	}
	r = <-ch
	t.Logf("beside an acknowledged batch: %v, %v", r.took, r.errs)
	if r.errs == nil || !errors.Is(r.errs[0], ErrPublishTimeout) || !errors.Is(r.errs[0], shard.ErrUnavailable) {
		t.Fatalf("beside an acknowledged batch: %v, want a PubAck timeout (unavailable)", r.errs)
	}
	if r.took >= cfg.PublishTimeout {
		t.Errorf("a lone straggler waited %v (PublishTimeout %v) although another batch's PubAck came meanwhile", r.took, cfg.PublishTimeout)
	}
}
