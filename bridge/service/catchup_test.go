package service

import (
	"github.com/delaybridge/delaybridge/config"
	"strconv"
	"testing"
	"time"
)

// TestCatchUpCancelPublishedBeforeDue (hunt H170): after the bridge was
// down past the due time of a task, a cancel or replace that its publisher
// sent before that due time, while the bridge was down, stops the old
// version. Without catch_up_wait the bridge fired an overdue task as soon
// as it held it (a task stored before the outage at start, one read from
// the backlog as its batch was ingested) and read the cancel or replace
// only later, when it found the task delivered and its id free: on both
// transports the cancelled task (or the old version) was delivered.
func TestCatchUpCancelPublishedBeforeDue(t *testing.T) {
	e := newEnv(t, "catch_up_wait: 1m\n")
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

// TestCatchUpWaitBounds: a source that cannot read its backlog (here its
// Kafka delay topic does not exist) holds firing for catch_up_wait, no
// longer; meanwhile the dead letters of the sources that do read go out
// (their source waits for them before it acknowledges, so holding them
// would hold the catch-up itself).
func TestCatchUpWaitBounds(t *testing.T) {
	e := newEnv(t, "catch_up_wait: 1m\n")
	t0 := e.clk.Now()
	svc, stop := e.start()
	e.publishNATS("delay.c", []byte("overdue"), "delay-id", "overdue",
		"delay-at", strconv.FormatInt(t0.Add(time.Second).UnixMilli(), 10), "delay-target", "orders.c")
	waitStored(t, svc, 1, "DELAY", "overdue")
	stop()

	e.mutate = func(c *config.Config) { c.Kafka.Sources[0].Topic = "absent" }
	e.clk.Advance(10 * time.Second)
	svc, _ = e.start()
	if !svc.Engine().FiringPaused() {
		t.Fatal("firing not paused at start")
	}
	e.publishNATS("delay.c", []byte("bad"), "delay-id", "bad", "delay-target", "orders.c") // missing-due
	e.waitFor("the dead letter", func(ds []delivery) bool { return len(byValue(ds, "dlq.delay")["bad"]) == 1 })
	if !svc.Engine().FiringPaused() {
		t.Fatal("firing resumed though the Kafka source has not read its (absent) topic")
	}
	if ds := byValue(e.deliveries(), "")["overdue"]; len(ds) != 0 {
		t.Fatalf("the overdue task was delivered while firing was paused: %+v", ds)
	}
	e.clk.Advance(time.Minute)
	e.waitFor("the overdue task", func(ds []delivery) bool { return len(byValue(ds, "orders.c")["overdue"]) == 1 })
	if svc.Engine().FiringPaused() {
		t.Fatal("firing still paused after catch_up_wait")
	}
}
