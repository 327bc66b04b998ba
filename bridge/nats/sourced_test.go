package nats

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
)

// TestSinkSourcedDelayStream: the delay stream sources its messages from
// another stream (a hub aggregating leaf streams). JetStream adds a
// Nats-Stream-Source header to every sourced message, which the sink must
// not forward: a JetStream target (or DLQ) refuses a publish carrying it
// with 10227 "message stream source header is not allowed".
func TestSinkSourcedDelayStream(t *testing.T) {
	cfg, nc, out := outServer(t)
	js := newJS(t, nc)
	ctx := ctxT(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EDGE", Subjects: []string{"delay.>"}}); err != nil {
		t.Fatal(err)
	}
	dl, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DELAY", Sources: []*jetstream.StreamSource{{Name: "EDGE"}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "delay.orders", []byte("v")); err != nil {
		t.Fatal(err)
	}
	var raw *jetstream.RawStreamMsg
	eventually(t, "sourced message", func() bool {
		raw, err = dl.GetMsg(ctx, 1)
		return err == nil
	})
	if raw.Header.Get("Nats-Stream-Source") == "" {
		t.Fatalf("sourced message has no Nats-Stream-Source: %v", raw.Header)
	}
	tk := task("id-1", "out.orders", "v", time.Now().UnixMilli(), headersIn(raw.Header)...)
	errs := newSink(t, nc, cfg).Deliver(ctx, []*codec.Task{tk})
	if errs != nil {
		t.Fatalf("deliver of a task read from a sourced delay stream: %v", errors.Join(errs...))
	}
	info, _ := out.Info(ctx)
	if info.State.Msgs != 1 {
		t.Fatalf("target holds %d", info.State.Msgs)
	}
}
