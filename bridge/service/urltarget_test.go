package service

import (
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/config"
)

// TestURLTargetRefused: a publisher who writes the broker URL form as
// delay-target ("nats://orders.x", "kafka://orders") gets a bad-target
// dead letter at once, on both transports. "//orders.x" is a legal NATS
// subject, so "nats://orders.x" was taken: with targets.allow ["*"] it
// waited until its due time and then was dead-lettered publish-failed
// with advice to create a stream for "//orders.x" or set
// nats.core_targets, and with nats.core_targets it was published to that
// subject, which nobody reads, and lost.
func TestURLTargetRefused(t *testing.T) {
	e := newEnv(t, "")
	e.mutate = func(c *config.Config) { c.Targets.Allow = []string{"*"}; c.NATS.CoreTargets = true }
	svc, _ := e.start()
	urls := []struct{ source, id, target string }{
		{"delay", "k-nats-url", "nats://orders.x"},
		{"delay", "k-kafka-url", "kafka://orders"},
		{"DELAY", "n-nats-url", "nats://orders.x"},
		{"DELAY", "n-kafka-url", "kafka://orders"},
	}
	for _, u := range urls {
		if u.source == "delay" {
			e.publishKafka(0, time.Time{}, []byte(u.id), []byte(u.id), "delay-after", "1h", "delay-target", u.target)
		} else {
			e.publishNATS("delay.u", []byte(u.id), "delay-after", "1h", "delay-target", u.target, "delay-id", u.id)
		}
	}
	// Sentinels behind them on the same partition and subject: once their
	// dead letters are out, the messages before them have been parsed.
	e.publishKafka(0, time.Time{}, []byte("k-sentinel"), []byte("k-sentinel"), "delay-target", "orders")
	e.publishNATS("delay.u", []byte("n-sentinel"), "delay-target", "orders.x")
	e.waitFor("the sentinels' dead letters", func(ds []delivery) bool {
		m := byValue(ds, "")
		return len(m["k-sentinel"]) > 0 && len(m["n-sentinel"]) > 0
	})
	for _, u := range urls {
		if ti, err := svc.Engine().Lookup(u.source, u.id); err == nil {
			t.Errorf("delay-target %q from %s taken in as a task for %s, want a bad-target dead letter", u.target, u.source, ti.Target)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	got := e.waitFor("six dead letters", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }) >= 6
	})
	for _, d := range got {
		if strings.HasSuffix(d.value, "sentinel") {
			continue
		}
		if code, detail := d.header("delay-error"), d.header("delay-error-detail"); code != "bad-target" || !strings.Contains(detail, "a URL") {
			t.Errorf("%s: dead-lettered %q (%s), want bad-target naming the URL form", d.value, code, detail)
		}
	}
}
