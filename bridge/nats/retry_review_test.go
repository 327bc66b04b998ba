package nats

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
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
	_, cfg, _, sink, _ := quorumLossSink(t)
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
