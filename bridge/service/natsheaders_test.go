package service

import (
	"net/url"
	"testing"
	"time"
)

// TestNATSSourceHeaderWithPercentKept (review R133): a NATS source header whose
// name has a '%' in it is a valid NATS header name; CONTRACT §2 says the
// target receives every source header except the control headers. NATS →
// NATS it must arrive under its own name, and the dead letter of a NATS
// source must keep the message unchanged (CONTRACT §3).
func TestNATSSourceHeaderWithPercentKept(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	e.publishNATS("delay.pct", []byte("pct"), "delay-after", "1s", "delay-target", "orders.pct", "50%", "five")
	// A dead letter (no due) of a NATS source with the same header.
	e.publishNATS("delay.pctdl", []byte("pctdl"), "delay-target", "orders.pct", "50%", "five")
	ds := e.advanceUntil("both delivered", func(ds []delivery) bool {
		return len(byValue(ds, "orders.pct")["pct"]) > 0 && len(byValue(ds, "dlq.delay")["pctdl"]) > 0
	})
	for _, v := range []string{"pct", "pctdl"} {
		d := byValue(ds, "")[v][0]
		if d.header("50%") != "five" {
			t.Errorf("%s to %s: header 50%% = %q; headers %q", v, d.dest, d.header("50%"), d.headers)
		}
	}
}

// TestNATSDedupKeyKeepsTasksApart (review R133): end to end, the Kafka keys
// "job-7 " and "job-7%20", scheduled for the same time to a NATS target,
// must not arrive with the same (delay-id, delay-due), the pair CONTRACT
// §2 tells consumers to dedup on, or a consumer following it drops one of
// two distinct tasks (the encoding's marker header is not part of the
// key); each decodes back to its key.
func TestNATSDedupKeyKeepsTasksApart(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	at := e.clk.Now().Add(2 * time.Second).UTC().Format("2006-01-02T15:04:05.000Z07:00")
	e.publishKafka(0, time.Time{}, []byte("job-7 "), []byte("first"), "delay-at", at, "delay-target", "nats:orders.x")
	e.publishKafka(0, time.Time{}, []byte("job-7%20"), []byte("second"), "delay-at", at, "delay-target", "nats:orders.x")
	ds := e.advanceUntil("both delivered", func(ds []delivery) bool {
		m := byValue(ds, "orders.x")
		return len(m["first"]) > 0 && len(m["second"]) > 0
	})
	m := byValue(ds, "orders.x")
	a, b := m["first"][0], m["second"][0]
	if a.header("delay-id") == b.header("delay-id") && a.header("delay-due") == b.header("delay-due") {
		t.Fatalf("distinct tasks arrived with one dedup key (delay-id %q, delay-due %q); delay-id-encoding %q vs %q",
			a.header("delay-id"), a.header("delay-due"), a.header("delay-id-encoding"), b.header("delay-id-encoding"))
	}
	for _, d := range []delivery{a, b} {
		id, err := url.PathUnescape(d.header("delay-id"))
		if err != nil || d.header("delay-id-encoding") != "percent" {
			t.Fatalf("%s: delay-id %q, delay-id-encoding %q (%v)", d.value, d.header("delay-id"), d.header("delay-id-encoding"), err)
		}
		if want := map[string]string{"first": "job-7 ", "second": "job-7%20"}[d.value]; id != want {
			t.Errorf("%s: delay-id decodes to %q, want %q", d.value, id, want)
		}
	}
}
