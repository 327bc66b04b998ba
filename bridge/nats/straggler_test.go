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
	"github.com/delaybridge/delaybridge/internal/natstest"
	"github.com/delaybridge/delaybridge/shard"
)

// TestStragglerOfQuorumLostStream (hunt H184): in a 3-node cluster an R3
// target stream's followers stop; its leader takes publishes and does
// not acknowledge them until it steps down (~20 s). A batch holding one
// task for it and tasks for a healthy stream (R1, on the same server)
// returned only after PublishTimeout (5 s here), the healthy tasks,
// acknowledged at once, waiting with it. Now the straggler gets a grace
// once the rest has its answers and fails as unavailable, and the healthy
// results come back within about the grace. A batch of that one task
// alone is not cut: it waits PublishTimeout as before. Once the followers
// are back the straggler's retry is acknowledged, and the stream holds
// one copy of it.
func TestStragglerOfQuorumLostStream(t *testing.T) {
	c, cfg, js, sink, leader := quorumLossSink(t)
	stopped := time.Now()

	batch := []*codec.Task{task("q1", "tq.a", "q", 1000)}
	for i := range 8 {
		batch = append(batch, task(fmt.Sprintf("h%d", i), "ok.a", "h", 1000))
	}
	began := time.Now()
	errs := sink.Deliver(ctxT(t), batch)
	took := time.Since(began)
	t.Logf("batch of 1 straggler + 8 healthy: %v (%v after the stop)", took, time.Since(stopped))
	if errs == nil || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("straggler: %v, want an ErrUnavailable", errs)
	}
	t.Logf("straggler: %v", errs[0])
	for i, err := range errs[1:] {
		if err != nil {
			t.Errorf("healthy task %d: %v", i, err)
		}
	}
	if took >= cfg.PublishTimeout {
		t.Errorf("the batch returned after %v: the healthy tasks waited for the straggler (PublishTimeout %v)", took, cfg.PublishTimeout)
	}

	// Alone, nothing else of the batch answers: the task is cut only if
	// the JetStream API answers the sink's ping (pingJS), which depends
	// on whether the surviving server leads the meta group and knows yet
	// that it lost its quorum; else it waits PublishTimeout. Either way
	// an outage.
	began = time.Now()
	errs = sink.Deliver(ctxT(t), []*codec.Task{task("q2", "tq.a", "q", 1000)})
	took = time.Since(began)
	t.Logf("batch of the straggler alone: %v, %v", took, errs)
	if errs == nil || !errors.Is(errs[0], shard.ErrUnavailable) {
		t.Fatalf("lone straggler: %v, want an ErrUnavailable", errs)
	}
	if took < cfg.PublishTimeout && !errors.Is(errs[0], ErrPublishTimeout) {
		t.Errorf("a batch of one failed after %v (PublishTimeout %v, %v after the stop): %v, want a cut or the timeout", took, cfg.PublishTimeout, time.Since(stopped), errs[0])
	}

	for i := range 3 {
		if i != leader {
			c.Start(i)
		}
	}
	c.WaitMeta()
	eventually(t, "TQ leader", func() bool { return c.StreamLeader("TQ") >= 0 })
	var last []error
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		last = sink.Deliver(ctxT(t), batch[:1])
		if last == nil || time.Now().After(deadline) {
			break
		}
	}
	if last != nil {
		t.Fatalf("the straggler's retry after the return: %v", last)
	}
	// Every message TQ holds (only tq.a goes there), each waited for as
	// long as a cluster just back may take to serve it. The read starts
	// again while the cluster answers with an error (CI at 3541948: "no
	// responders available for request" at the ordered consumer's first
	// fetch, right after the return).
	id := DeliveryID(batch[0])
	n, err := copiesIn(js, "TQ", "tq.a", id)
	for deadline := time.Now().Add(60 * time.Second); err != nil && time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		t.Logf("reading TQ again: %v", err)
		n, err = copiesIn(js, "TQ", "tq.a", id)
	}
	if err != nil {
		t.Fatalf("read TQ's messages: %v", err)
	}
	if n != 1 {
		t.Errorf("TQ holds %d copies of the straggler, want 1", n)
	}
}

// TestSlowSubjectNotCutAgain: a subject that answers late but works (here
// a responder that sends its PubAck 2.5 s late, as a stream far away
// would) is cut once in a batch with fast answers; its late PubAck marks
// it slow, and the next batches wait for it.
func TestSlowSubjectNotCutAgain(t *testing.T) {
	cfg, nc, js, _ := createdSource(t, nil)
	if _, err := js.CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OK", Subjects: []string{"ok.>"}}); err != nil {
		t.Fatal(err)
	}
	seq := 0
	sub, err := nc.Subscribe("slow.a", func(m *natsgo.Msg) {
		seq++
		// Well past the grace (4 x what the fast ones took, 500 ms at
		// least) even when the machine is loaded.
		time.Sleep(2500 * time.Millisecond)
		_ = m.Respond(fmt.Appendf(nil, `{"stream":"SLOW","seq":%d}`, seq))
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	sink := newSink(t, nc, cfg)
	sink.setVerdict("slow.a", false) // a stream subject, no probe
	batch := func(n int) []*codec.Task {
		b := []*codec.Task{task(fmt.Sprintf("s%d", n), "slow.a", "s", 1)}
		for i := range 4 {
			b = append(b, task(fmt.Sprintf("o%d-%d", n, i), "ok.a", "o", 1))
		}
		return b
	}
	errs := sink.Deliver(ctxT(t), batch(1))
	if errs == nil || !errors.Is(errs[0], shard.ErrUnavailable) || errs[1] != nil {
		t.Fatalf("first batch: %v, want the slow one cut as unavailable, the rest delivered", errs)
	}
	eventually(t, "the cut publish noted slow", func() bool { return sink.slowSubject("slow.a") })
	for n := 2; n <= 3; n++ {
		if errs := sink.Deliver(ctxT(t), batch(n)); errs != nil {
			t.Fatalf("batch %d: %v, want the slow subject waited for", n, errs)
		}
	}
}

// quorumLossSink starts a 3-node cluster with an R1 stream OK (ok.>) and
// an R3 stream TQ (tq.>) whose leader is on OK's server, connects a Sink
// there (PublishTimeout 5 s), warms both subjects up (no probes), and
// stops the other two servers: TQ's leader then takes publishes and
// does not acknowledge them until it steps down (~20 s). It returns the
// cluster, the sink's config, a JetStream client on the leader's server
// and the leader's index.
func quorumLossSink(t *testing.T) (*natstest.Cluster, Config, jetstream.JetStream, *Sink, int) {
	t.Helper()
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
	// TQ's leader on the healthy R1 stream's server, the bridge there too.
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
	js := newJS(t, nc)
	cfg.PublishTimeout = 5 * time.Second
	sink := newSink(t, nc, cfg)
	// Both subjects known to have a stream (no probes).
	if errs := sink.Deliver(ctxT(t), []*codec.Task{task("w1", "tq.a", "w", 1), task("w2", "ok.a", "w", 1)}); errs != nil {
		t.Fatalf("warm-up: %v", errs)
	}
	for i := range 3 {
		if i != leader {
			c.Stop(i)
		}
	}
	return c, cfg, js, sink, leader
}

// copiesIn reads every message of stream on subject with an ordered
// consumer (each waited up to 10 s) and counts those with Nats-Msg-Id id.
func copiesIn(js jetstream.JetStream, stream, subject, id string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		return 0, fmt.Errorf("ordered consumer: %w", err)
	}
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return 0, fmt.Errorf("stream info: %w", err)
	}
	total := st.CachedInfo().State.Msgs
	n := 0
	for i := range total {
		fctx, fcancel := context.WithTimeout(context.Background(), 10*time.Second)
		m, err := cons.Next(jetstream.FetchContext(fctx))
		fcancel()
		if err != nil {
			return 0, fmt.Errorf("message %d of %d: %w", i+1, total, err)
		}
		if m.Headers().Get(natsgo.MsgIdHdr) == id {
			n++
		}
	}
	return n, nil
}
