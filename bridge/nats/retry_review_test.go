package nats

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/natstest"
	"github.com/delaybridge/delaybridge/shard"
)

// TestRetryOfCutStragglerStillCut (review R188): an R3 stream lost its
// quorum; a batch's task for it is cut (as in
// TestStragglerOfQuorumLostStream). Its retry, with the same Nats-Msg-Id,
// is answered at once "duplicate message id is in process": an error
// answer from the stuck subject. The retry batch also holds a new task for
// the same subject and healthy tasks; the new task should be cut within
// the grace too, not held (with the healthy tasks) until PublishTimeout.
func TestRetryOfCutStragglerStillCut(t *testing.T) {
	c := natstest.StartCluster(t, 3)
	cfg := testConfig(t, c.URL(0))
	nc0 := connect(t, cfg)
	js0 := newJS(t, nc0)
	create := func(js jetstream.JetStream, sc jetstream.StreamConfig) {
		t.Helper()
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			_, err := js.CreateStream(ctx, sc)
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("create stream %s: %v", sc.Name, err)
			}
		}
		eventually(t, sc.Name+" leader", func() bool { return c.StreamLeader(sc.Name) >= 0 })
	}
	create(js0, jetstream.StreamConfig{Name: "OK", Subjects: []string{"ok.>"}, Replicas: 1})
	create(js0, jetstream.StreamConfig{Name: "TQ", Subjects: []string{"tq.>"}, Replicas: 3})
	leader := c.StreamLeader("OK")
	for i := 0; c.StreamLeader("TQ") != leader; i++ {
		if i == 30 {
			t.Fatalf("TQ's leader stays off server %d", leader)
		}
		_, _ = nc0.Request("$JS.API.STREAM.LEADER.STEPDOWN.TQ", nil, 2*time.Second)
		eventually(t, "TQ leader", func() bool { return c.StreamLeader("TQ") >= 0 })
	}
	cfg.URL = c.URL(leader)
	nc := connect(t, cfg)
	cfg.PublishTimeout = 5 * time.Second
	sink := newSink(t, nc, cfg)
	if errs := sink.Deliver(ctxT(t), []*codec.Task{task("w1", "tq.a", "w", 1), task("w2", "ok.a", "w", 1)}); errs != nil {
		t.Fatalf("warm-up: %v", errs)
	}
	for i := range 3 {
		if i != leader {
			c.Stop(i)
		}
	}
	healthy := func(p string) []*codec.Task {
		var ts []*codec.Task
		for i := range 8 {
			ts = append(ts, task(fmt.Sprintf("%s%d", p, i), "ok.a", p, 1000))
		}
		return ts
	}
	q1 := task("q1", "tq.a", "q", 1000)
	errs := sink.Deliver(ctxT(t), append([]*codec.Task{q1}, healthy("h")...))
	if errs == nil || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("first batch's straggler: %v, want an ErrUnavailable", errs)
	}

	// The outage's retry: the cut task again, a new one for its subject.
	batch := append([]*codec.Task{q1, task("q3", "tq.a", "q", 1000)}, healthy("g")...)
	began := time.Now()
	errs = sink.Deliver(ctxT(t), batch)
	took := time.Since(began)
	t.Logf("retry batch: %v", took)
	if errs == nil {
		t.Fatalf("retry batch: no errors, want the stuck stream's tasks failed")
	}
	t.Logf("retried task: %v", errs[0])
	t.Logf("new task: %v", errs[1])
	for i, err := range errs[2:] {
		if err != nil {
			t.Errorf("healthy task %d: %v", i, err)
		}
	}
	if took >= cfg.PublishTimeout {
		t.Errorf("the retry batch returned after %v: its healthy tasks waited PublishTimeout (%v) for the stuck stream's new task", took, cfg.PublishTimeout)
	}
}
