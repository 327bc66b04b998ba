package service

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/shard"
)

// TestOperatorPauseEndToEnd: an operator pauses firing through the admin
// API on a running bridge. On both transports the sources keep taking
// messages in (and a dead letter still reaches its DLQ, so a source is
// not held), but nothing reaches a target while the pause holds: past the
// tasks' due times, and after a restart of the bridge, which finds the
// pause in its store. POST /v1/firing/resume then delivers each task
// once.
func TestOperatorPauseEndToEnd(t *testing.T) {
	e := newEnv(t, "")
	svc, stop := e.start()
	eventually(t, "the catch-up at start over", func() bool { return !svc.Engine().Firing().CatchingUp })
	srv := httptest.NewServer(svc.AdminHandler())
	code, body := adminSend(t, srv, "POST", "/v1/firing/pause", `{"reason": "orders-svc deploy"}`)
	var st shard.FiringState
	if err := json.Unmarshal([]byte(body), &st); code != http.StatusOK || err != nil || !st.Paused || st.Operator == nil || st.Operator.Reason != "orders-svc deploy" {
		t.Fatalf("POST /v1/firing/pause = %d %q (%v)", code, body, err)
	}
	srv.Close()

	e.publishKafka(0, time.Time{}, []byte("k1"), []byte("kafka-1"), "delay-after", "1s", "delay-target", "orders")
	e.publishKafka(1, time.Time{}, []byte("k2"), []byte("kafka-2"), "delay-after", "2s", "delay-target", "nats:orders.x")
	e.publishKafka(0, time.Time{}, []byte("k3"), []byte("kafka-bad"), "delay-target", "orders") // missing-due
	e.publishNATS("delay.p", []byte("nats-1"), "delay-id", "n1", "delay-after", "1s", "delay-target", "orders.p")
	e.publishNATS("delay.p", []byte("nats-bad"), "delay-id", "n2", "delay-target", "orders.p") // missing-due
	waitStored(t, svc, 3, "delay", "k1", "k2")
	waitStored(t, svc, 3, "DELAY", "n1")
	e.waitFor("the dead letters while paused", func(ds []delivery) bool {
		return len(byValue(ds, kafkaDLQ)["kafka-bad"]) == 1 && len(byValue(ds, "dlq.delay")["nats-bad"]) == 1
	})
	e.clk.Advance(time.Minute)
	waitSetAside(t, svc, 3)
	if got := targetDeliveries(e); len(got) != 0 {
		t.Fatalf("delivered while paused by the operator: %v", got)
	}

	// A restart finds the pause in the store.
	stop()
	e.clk.Advance(time.Minute)
	svc, _ = e.start()
	eventually(t, "the catch-up at start over after the restart", func() bool { return !svc.Engine().Firing().CatchingUp })
	if st := svc.Engine().Firing(); !st.Paused || st.Operator == nil || st.Operator.Reason != "orders-svc deploy" {
		t.Fatalf("after a restart Firing() = %+v, want the operator's pause", st)
	}
	e.clk.Advance(time.Minute)
	waitSetAside(t, svc, 3)
	if got := targetDeliveries(e); len(got) != 0 {
		t.Fatalf("delivered after a restart while paused by the operator: %v", got)
	}

	srv = httptest.NewServer(svc.AdminHandler())
	defer srv.Close()
	if code, body := adminCall(t, srv, "GET", "/v1/firing"); code != http.StatusOK || !strings.Contains(body, `"reason":"orders-svc deploy"`) {
		t.Fatalf("GET /v1/firing = %d %q", code, body)
	}
	if code, body := adminSend(t, srv, "POST", "/v1/firing/resume", ""); code != http.StatusOK || !strings.Contains(body, `"paused":false`) {
		t.Fatalf("POST /v1/firing/resume = %d %q", code, body)
	}
	e.waitFor("the tasks after the resume", func(ds []delivery) bool {
		return len(byValue(ds, kafkaOut)["kafka-1"]) > 0 && len(byValue(ds, "orders.x")["kafka-2"]) > 0 && len(byValue(ds, "orders.p")["nats-1"]) > 0
	})
	e.settle(svc)
	for v, n := range targetDeliveries(e) {
		if n != 1 {
			t.Errorf("%s delivered %d times, want once", v, n)
		}
	}
	eventually(t, "nothing pending after the resume", func() bool { return svc.Engine().Stats().Pending == 0 })
}

// waitSetAside waits until the fire loops took every task due out of the
// wheels while firing is paused (set aside, not in_wheel) with pending
// still stored: a loop that fired them instead would have taken them out
// of the wheel the same way, and the deliveries checked after it show it.
func waitSetAside(t *testing.T, svc *Service, pending int64) {
	t.Helper()
	eventually(t, "the due tasks out of the wheels", func() bool {
		for _, sh := range svc.Engine().Stats().Shards {
			if sh.InWheel != 0 {
				return false
			}
		}
		return true
	})
	if n := svc.Engine().Stats().Pending; n != pending {
		t.Fatalf("%d pending while firing is paused, want %d", n, pending)
	}
}

// targetDeliveries counts the deliveries to targets (not to a DLQ) by value.
func targetDeliveries(e *env) map[string]int {
	out := map[string]int{}
	for _, d := range e.deliveries() {
		if d.dest != kafkaDLQ && !strings.HasPrefix(d.dest, "dlq.") {
			out[d.value]++
		}
	}
	return out
}
