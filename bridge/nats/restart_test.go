package nats

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
)

// forward is a Handler that delivers each batch through a Sink at once, a
// stand-in for the engine with a zero delay. The due time is the source
// sequence, so a redelivered firing has the same Nats-Msg-Id.
type forward struct {
	sink    *Sink
	target  string
	handled atomic.Int64
	failed  atomic.Int64
}

func (f *forward) Checkpoint(string) (int64, bool, error) { return 0, false, nil }

func (f *forward) Handle(ctx context.Context, b *bridge.Batch) error {
	tasks := make([]*codec.Task, len(b.Items))
	for i, it := range b.Items {
		tasks[i] = &codec.Task{
			Kind: codec.KindSchedule, ID: it.Msg.Origin(), Origin: it.Msg.Origin(), Due: it.Msg.Offset,
			Transport: codec.TransportNATS, Target: f.target, Value: it.Msg.Value, Headers: it.Msg.Headers,
		}
	}
	if errs := f.sink.Deliver(ctx, tasks); errs != nil {
		f.failed.Add(1)
		return errors.Join(errs...)
	}
	f.handled.Add(int64(len(tasks)))
	return nil
}

// publishUntilAcked publishes with a message id until JetStream
// acknowledges, riding out a server restart without storing duplicates.
func publishUntilAcked(js jetstream.JetStream, subject, data string) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := js.PublishMsg(ctx, &natsgo.Msg{Subject: subject, Data: []byte(data)}, jetstream.WithMsgID("pub-"+data))
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("publish %s: %w", data, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func publishRetry(t *testing.T, js jetstream.JetStream, subject, data string) {
	t.Helper()
	if err := publishUntilAcked(js, subject, data); err != nil {
		t.Fatal(err)
	}
}

// TestServerRestart: the server goes away and comes back on the same port
// and store. Source and Sink report unhealthy meanwhile, recover on their
// own, and every message reaches the target exactly once.
func TestServerRestart(t *testing.T) {
	opts := jsOptions(t)
	s := startServer(t, opts)
	cfg := testConfig(t, serverURL(s))
	cfg.Create = true
	cfg.AckWait = 2 * time.Second // bounds the wait for deliveries lost with the connection
	cfg.PublishTimeout = 2 * time.Second
	nc := connect(t, cfg)
	pubNC := connect(t, cfg)
	pub := newJS(t, pubNC)
	if _, err := newJS(t, nc).CreateStream(ctxT(t), jetstream.StreamConfig{Name: "OUT", Subjects: []string{"out.>"}}); err != nil {
		t.Fatal(err)
	}
	src, err := NewSource(nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	sink := newSink(t, nc, cfg)
	fwd := &forward{sink: sink, target: "out.x"}
	runSource(t, src, fwd)

	const half = 100
	for i := range half {
		publishRetry(t, pub, "delay.x", strconv.Itoa(i))
	}
	eventually(t, "first half forwarded", func() bool { return fwd.handled.Load() >= half })

	// The second half is published while the server goes away: messages
	// are in flight in every direction when it stops.
	var published atomic.Int64
	pubErr := make(chan error, 1)
	go func() {
		for i := half; i < 2*half; i++ {
			if err := publishUntilAcked(pub, "delay.x", strconv.Itoa(i)); err != nil {
				pubErr <- err
				return
			}
			published.Add(1)
		}
		pubErr <- nil
	}()
	eventually(t, "second half under way", func() bool { return published.Load() >= 20 })

	port := s.Addr().(*net.TCPAddr).Port
	s.Shutdown()
	s.WaitForShutdown()
	eventually(t, "source and sink unhealthy", func() bool { return src.Health() != nil && sink.Health() != nil })
	if !errors.Is(src.Health(), ErrDisconnected) {
		t.Errorf("source health = %v", src.Health())
	}
	o := opts.Clone()
	o.Port = port
	startServer(t, o) // same port and store directory
	eventually(t, "source and sink healthy", func() bool { return src.Health() == nil && sink.Health() == nil })
	if err := <-pubErr; err != nil {
		t.Fatal(err)
	}

	out, err := newJS(t, nc).Stream(ctxT(t), "OUT")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "all forwarded", func() bool {
		info, err := out.Info(ctxT(t))
		return err == nil && info.State.Msgs >= 2*half
	})
	info, _ := out.Info(ctxT(t))
	if info.State.Msgs != 2*half {
		t.Fatalf("target holds %d messages, want %d", info.State.Msgs, 2*half)
	}
	var got []int
	for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
		m, err := out.GetMsg(ctxT(t), seq)
		if err != nil {
			t.Fatalf("get %d: %v", seq, err)
		}
		v, _ := strconv.Atoi(string(m.Data))
		got = append(got, v)
	}
	slices.Sort(got)
	for i, v := range got {
		if v != i {
			t.Fatalf("target values %v: missing or duplicate at %d", got, i)
		}
	}
	eventually(t, "delay stream fully acked", func() bool {
		ci := consumerInfo(t, newJS(t, nc), "DELAY", "bridge")
		return ci.NumAckPending == 0 && ci.NumPending == 0
	})
	t.Logf("handled %d (re-handled %d), failed handle calls %d", fwd.handled.Load(), fwd.handled.Load()-2*half, fwd.failed.Load())
}
