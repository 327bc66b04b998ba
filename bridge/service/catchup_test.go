package service

import (
	"os"
	"strconv"
	"testing"
	"time"
)

// TestCatchUpCancelPublishedBeforeDue is the reproduction of a known gap
// (hunt H170), skipped unless DELAYBRIDGE_KNOWN_GAPS=1: after the bridge was
// down past the due time of a task, a cancel or replace that its publisher
// sent before that due time, while the bridge was down, does not stop the
// old version. The bridge fires an overdue task as soon as it holds it (a
// task stored before the outage at start, one read from the backlog as its
// batch is ingested) and reads the cancel or replace only later, when it
// finds the task delivered and its id free. Had the bridge been up, the
// task would never have fired (or only in its new version). README "After
// an outage: catching up" documents this; the test shows it on both
// transports and passes once the bridge reads a source's messages up to a
// task's due time before it fires the task.
func TestCatchUpCancelPublishedBeforeDue(t *testing.T) {
	if os.Getenv("DELAYBRIDGE_KNOWN_GAPS") == "" {
		t.Skip("known gap (README: After an outage: catching up); DELAYBRIDGE_KNOWN_GAPS=1 runs it")
	}
	e := newEnv(t, "")
	t0 := e.clk.Now()
	at := func(d time.Duration) string { return strconv.FormatInt(t0.Add(d).UnixMilli(), 10) }

	// Before the outage: two tasks per transport due in 10 s, stored.
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("stored-cancel"), []byte("k-stored-cancel"), "delay-at", at(10*time.Second), "delay-target", "orders")
	e.publishKafka(0, time.Time{}, []byte("stored-replace"), []byte("k-stored-replace-v1"), "delay-at", at(10*time.Second), "delay-target", "orders")
	e.publishNATS("delay.c", []byte("n-stored-cancel"), "delay-id", "stored-cancel", "delay-at", at(10*time.Second), "delay-target", "orders.c")
	e.publishNATS("delay.c", []byte("n-stored-replace-v1"), "delay-id", "stored-replace", "delay-at", at(10*time.Second), "delay-target", "orders.c")
	waitStored(t, svc, 4, "delay", "stored-cancel", "stored-replace")
	waitStored(t, svc, 4, "DELAY", "stored-cancel", "stored-replace")
	stop()

	// The outage. At t0+5s, before the tasks are due, their publishers
	// cancel one and replace the other (due in 2 h); then the backlog goes
	// on: a task due at t0+20s, cancelled and replaced at t0+30s (before
	// its due time, t0+60s) behind more than a batch of other messages.
	ts := t0.Add(5 * time.Second)
	e.publishKafka(0, ts, []byte("stored-cancel"), []byte("cancel"), "delay-cancel", "true")
	e.publishKafka(0, ts, []byte("stored-replace"), []byte("k-stored-replace-v2"), "delay-at", at(2*time.Hour), "delay-target", "orders")
	e.publishNATS("delay.c", []byte("cancel"), "delay-id", "stored-cancel", "delay-cancel", "true")
	e.publishNATS("delay.c", []byte("n-stored-replace-v2"), "delay-id", "stored-replace", "delay-at", at(2*time.Hour), "delay-target", "orders.c")
	e.publishKafka(0, t0.Add(20*time.Second), []byte("backlog-cancel"), []byte("k-backlog-cancel"), "delay-at", at(time.Minute), "delay-target", "orders")
	e.publishKafka(0, t0.Add(20*time.Second), []byte("backlog-replace"), []byte("k-backlog-replace-v1"), "delay-at", at(time.Minute), "delay-target", "orders")
	e.publishNATS("delay.c", []byte("n-backlog-cancel"), "delay-id", "backlog-cancel", "delay-at", at(time.Minute), "delay-target", "orders.c")
	e.publishNATS("delay.c", []byte("n-backlog-replace-v1"), "delay-id", "backlog-replace", "delay-at", at(time.Minute), "delay-target", "orders.c")
	// More than a NATS batch (256 messages) and a Kafka fetch (about 1
	// MiB a partition) in between, so the cancels come in a later batch.
	const fillers = 600
	pad := string(make([]byte, 4096))
	for i := range fillers {
		v := []byte("filler-" + strconv.Itoa(i) + pad)
		e.publishKafka(0, t0.Add(25*time.Second), []byte("k-filler-"+strconv.Itoa(i)), v, "delay-at", at(40*time.Second), "delay-target", "orders")
		e.publishNATS("delay.c", v, "delay-id", "n-filler-"+strconv.Itoa(i), "delay-at", at(40*time.Second), "delay-target", "orders.c")
	}
	ts = t0.Add(30 * time.Second)
	e.publishKafka(0, ts, []byte("backlog-cancel"), []byte("cancel"), "delay-cancel", "true")
	e.publishKafka(0, ts, []byte("backlog-replace"), []byte("k-backlog-replace-v2"), "delay-at", at(2*time.Hour), "delay-target", "orders")
	e.publishNATS("delay.c", []byte("cancel"), "delay-id", "backlog-cancel", "delay-cancel", "true")
	e.publishNATS("delay.c", []byte("n-backlog-replace-v2"), "delay-id", "backlog-replace", "delay-at", at(2*time.Hour), "delay-target", "orders.c")

	// The bridge comes back an hour later: everything but the two
	// replacements (due in 2 h) is overdue.
	e.clk.Advance(time.Hour)
	svc, _ = e.start()
	e.waitFor("the fillers", func(ds []delivery) bool { return len(ds) >= 2*fillers })
	eventually(t, "the backlog taken in", func() bool { return svc.Engine().Stats().Pending == 4 })
	e.settle(svc)
	e.clk.Advance(2 * time.Hour)
	e.waitFor("the replacements", func(ds []delivery) bool {
		n := 0
		for _, d := range ds {
			switch d.value {
			case "k-stored-replace-v2", "n-stored-replace-v2", "k-backlog-replace-v2", "n-backlog-replace-v2":
				n++
			}
		}
		return n == 4
	})
	e.settle(svc)
	got := byValue(e.deliveries(), "")
	for _, p := range []string{"k-", "n-"} {
		for _, v := range []string{"stored-cancel", "stored-replace-v1", "backlog-cancel", "backlog-replace-v1"} {
			if ds := got[p+v]; len(ds) != 0 {
				t.Errorf("%s%s delivered %d times, though cancelled or replaced by a message published before its due time", p, v, len(ds))
			}
		}
	}
}
