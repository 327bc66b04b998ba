package service

import (
	"context"
	"testing"

	"github.com/nats-io/nats.go/jetstream"
)

// TestSourcedDelayStream: the delay stream DELAY is a hub that sources
// its delay messages from an edge stream (the usual leaf/hub layout), so
// JetStream adds Nats-Stream-Source to each. Forwarded, it would make the
// target stream refuse every delivery (10227) and the DLQ stream every
// dead letter, holding the bad message's ack forever: both must arrive.
func TestSourcedDelayStream(t *testing.T) {
	e := newEnv(t, "")
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EDGE", Subjects: []string{"edge.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"},
		Sources: []*jetstream.StreamSource{{Name: "EDGE", SubjectTransforms: []jetstream.SubjectTransformConfig{{Source: "edge.>", Destination: "delay.>"}}}}}); err != nil {
		t.Fatal(err)
	}
	e.start()
	e.publishNATS("edge.o", []byte("good"), "delay-after", "1s", "delay-target", "orders.o")
	e.publishNATS("edge.o", []byte("bad"), "delay-target", "orders.o") // missing-due
	e.advanceUntil("the delivery and the dead letter", func(ds []delivery) bool {
		return len(byValue(ds, "orders.o")["good"]) > 0 && len(byValue(ds, "dlq.delay")["bad"]) > 0
	})
}
