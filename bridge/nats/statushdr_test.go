package nats

import (
	"testing"

	natsgo "github.com/nats-io/nats.go"

	"github.com/delaybridge/delaybridge/codec"
)

// TestUserStatusHeader: a delay message with an empty body and a header
// named Status (an application's own, e.g. "Status: paid" on a cancel) is
// a message, not a status of the pull that delivered it. nats.go's
// iterator took it for one: never handed over, redelivered after every
// AckWait (lost at max_deliver); with "Status: 100" a pull that answers
// heartbeats would have acked it unread.
func TestUserStatusHeader(t *testing.T) {
	_, _, js, src := createdSource(t, nil)
	values := []string{"paid", "100", "404", "408", "409"}
	for _, v := range values {
		h := natsgo.Header{}
		h.Set("delay-after", "1h")
		h.Set("Status", v)
		h.Set("Description", "Request Timeout")
		publish(t, js, "delay.orders", "", h)
	}
	publish(t, js, "delay.orders", "after", nil)
	rec := newRecorder()
	runSource(t, src, rec)
	want := len(values) + 1
	eventually(t, "every message handed over", func() bool { return len(rec.seqs()) == want })
	eventually(t, "every message acked", func() bool {
		ci := consumerInfo(t, js, "DELAY", "bridge")
		return ci.AckFloor.Stream == uint64(want) && ci.NumAckPending == 0
	})
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for i, it := range rec.items[:len(values)] {
		if got := headerValue(it.Msg.Headers, "Status"); got != values[i] {
			t.Errorf("message %d: Status header %q, want %q", i, got, values[i])
		}
	}
}

func headerValue(hs []codec.Header, key string) string {
	for _, h := range hs {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}
