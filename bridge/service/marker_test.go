package service

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// TestSubjectDeleteMarkerSkipped: an operator's delay stream keeps
// messages for a while (limits retention, max_age) with subject delete
// markers on (subject_delete_marker_ttl). When a delay subject's last
// message ages out, the server stores a marker on that subject: an empty
// message with Nats-Marker-Reason: MaxAge. It is not a publisher's
// message: the bridge acks it and takes nothing in, where it used to
// dead-letter one missing-due per subject.
func TestSubjectDeleteMarkerSkipped(t *testing.T) {
	e := newEnv(t, "")
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "DELAY", Subjects: []string{"delay.>"},
		MaxAge: 2 * time.Second, AllowMsgTTL: true, SubjectDeleteMarkerTTL: time.Second, Duplicates: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	svc, _ := e.start()
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	e.publishNATS("delay.o", []byte("first"), "delay-after", "1s", "delay-target", "orders.o")
	e.advanceUntil("the first delivery", func(ds []delivery) bool { return len(byValue(ds, "orders.o")["first"]) > 0 })

	// The server's clock ages the message out (real time, 2 s).
	st, err := js.Stream(ctx, "DELAY")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the marker stored", func() bool {
		info, err := st.Info(ctx)
		return err == nil && info.State.LastSeq >= 2
	})
	m, err := st.GetMsg(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	if m.Header.Get("Nats-Marker-Reason") == "" || len(m.Data) != 0 {
		t.Fatalf("stream DELAY #2 is not a marker: subject %q headers %v data %q", m.Subject, m.Header, m.Data)
	}

	// A message after the marker: the consumer delivers in stream order,
	// so once it is taken in the marker was handled.
	e.publishNATS("delay.p", []byte("after"), "delay-after", "1s", "delay-target", "orders.p")
	ds := e.advanceUntil("the delivery after the marker", func(ds []delivery) bool { return len(byValue(ds, "orders.p")["after"]) > 0 })
	for _, d := range ds {
		if d.dest == "dlq.delay" {
			t.Errorf("dead letter %q %v: the marker was taken in", d.value, d.headers)
		}
	}
	cons, err := js.Consumer(ctx, "DELAY", "bridge") // env's nats.consumer
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, "the marker acked", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.AckFloor.Stream >= 2
	})
}
