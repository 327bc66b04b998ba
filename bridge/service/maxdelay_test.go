package service

import (
	"testing"
	"time"
)

// TestMaxDelayBoundsHoldFromNow: a Kafka producer sets CreateTime freely
// (a clock set forward, an unset RTC). max_delay (30d here) bounds how long
// the bridge holds a task even then: with the message time ahead of the
// bridge's clock, the bound counts from the bridge's time. Before, a
// record stamped 100 years ahead with delay-after 1s was held for 100
// years, and one stamped 40 days ahead took a delay-at 60 days out.
func TestMaxDelayBoundsHoldFromNow(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	now := e.clk.Now()
	day := 24 * time.Hour
	e.publishKafka(0, now.Add(100*365*day), []byte("skew-after"), []byte("skew-after"),
		"delay-after", "1s", "delay-target", "orders")
	e.publishKafka(0, now.Add(40*day), []byte("skew-at"), []byte("skew-at"),
		"delay-at", now.Add(60*day).UTC().Format(time.RFC3339), "delay-target", "orders")
	// The same skew within the bound from the bridge's time is held.
	e.publishKafka(0, now.Add(40*day), []byte("skew-ok"), []byte("skew-ok"),
		"delay-at", now.Add(20*day).UTC().Format(time.RFC3339), "delay-target", "orders")
	got := e.waitFor("two dead letters", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ }) >= 2
	})
	vals := byValue(got, kafkaDLQ)
	for _, v := range []string{"skew-after", "skew-at"} {
		d := one(t, vals, v)
		if code := d.header("delay-error"); code != "delay-too-long" {
			t.Errorf("%s dead-lettered with %q, want delay-too-long", v, code)
		}
	}
	// The source committed past all three (their dead letters were
	// acknowledged first), so skew-ok is either held or dead-lettered.
	eventually(t, "offsets committed", func() bool { return e.committedOffset(0) >= 3 })
	if _, err := svc.Engine().Lookup("delay", "skew-ok"); err != nil {
		t.Errorf("skew-ok not held: %v", err)
	}
	if ds := byValue(e.deliveries(), kafkaDLQ)["skew-ok"]; len(ds) != 0 {
		t.Errorf("skew-ok dead-lettered: %q", ds[0].header("delay-error-detail"))
	}
}
