package service

import (
	"net/url"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestReplayedDeadLetterWithoutDelayError: a dead letter replayed as it
// is, with only delay-target corrected, reaches the target without the
// dead letter's delay-error and delay-error-detail: a consumer would see
// a successful delivery marked as an error (hunt H165).
func TestReplayedDeadLetterWithoutDelayError(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	e.publishKafka(0, time.Time{}, []byte("job"), []byte("typo"), "delay-after", "0", "delay-target", "kafak:orders")
	dl := one(t, byValue(e.waitFor("the dead letter", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)["typo"]) > 0 }), kafkaDLQ), "typo")
	e.publishKafka(0, time.Time{}, []byte(dl.key), []byte(dl.value), asIs(dl, codec.HeaderTarget, kafkaOut)...)
	d := one(t, byValue(e.advanceUntil("the replay", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["typo"]) > 0 }), kafkaOut), "typo")
	if v := headerValues(d, codec.HeaderError); len(v) != 0 {
		t.Fatalf("replayed dead letter delivered with delay-error %q, delay-error-detail %q", v, headerValues(d, codec.HeaderErrorDetail))
	}
}

// TestNATSDeadLetterKeepsTaskID: a NATS message whose task id is its
// Nats-Msg-Id (README's own example) and that is dead-lettered at ingest
// reaches the DLQ with the bridge's Nats-Msg-Id in place of its own, and
// the work-queue delay stream has deleted the source message: the dead
// letter carries the id as delay-id, so a replay keeps it (hunt H165).
func TestNATSDeadLetterKeepsTaskID(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	e.publishNATS("delay.x", []byte("typo"), "Nats-Msg-Id", "order-7", "delay-after", "90s", "delay-target", "kafak:orders")
	dl := one(t, byValue(e.waitFor("the dead letter", func(ds []delivery) bool { return len(byValue(ds, "dlq.delay")["typo"]) > 0 }), "dlq.delay"), "typo")
	if v := headerValues(dl, codec.HeaderID); len(v) != 1 || v[0] != "order-7" {
		var hs []string
		for _, h := range dl.headers {
			hs = append(hs, h.Key+"="+string(h.Value))
		}
		t.Fatalf("the dead letter's delay-id %q, want [order-7]; headers %q", v, hs)
	}
}

// TestPercentEncodedIDKeptAcrossHops: a Kafka task id that reaches a NATS
// target percent-encoded (a '%' in it) and is republished as it arrived,
// with delay-id-encoding, to go on with its chain, keeps its id: it was
// encoded once more at each NATS delivery ("50%25off", then
// "50%2525off"; hunt H165).
func TestPercentEncodedIDKeptAcrossHops(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	e.publishKafka(0, time.Time{}, []byte("50%off"), []byte("hop"), "retry-count", "0", "delay-after", "0", "delay-target", "nats:orders.p")
	ds := e.advanceUntil("hop 0", func(ds []delivery) bool { return len(byValue(ds, "orders.p")["hop"]) > 0 })
	h0 := byValue(ds, "orders.p")["hop"][0]
	e.publishKafka(0, time.Time{}, []byte("50%off"), []byte("hop"), asIs(h0, "retry-count", "1", "delay-after", "0", "delay-target", "nats:orders.p")...)
	ds = e.advanceUntil("hop 1", func(ds []delivery) bool { return len(byValue(ds, "orders.p")["hop"]) > 1 })
	checkHopIDs(t, byValue(ds, "orders.p")["hop"], "50%off")
}

// checkHopIDs checks that each delivered hop's delay-id, decoded when it
// came with delay-id-encoding: percent, is the chain's id.
func checkHopIDs(t *testing.T, hops []delivery, want string) {
	t.Helper()
	for _, d := range hops {
		id := d.header(codec.HeaderID)
		if d.header(codec.HeaderIDEncoding) == codec.IDEncodingPercent {
			var err error
			if id, err = url.PathUnescape(id); err != nil {
				t.Fatal(err)
			}
		}
		if id != want {
			t.Errorf("hop %s: delay-id %q (encoding %q) decodes to %q, want the chain's id %q",
				d.header("retry-count"), d.header(codec.HeaderID), d.header(codec.HeaderIDEncoding), id, want)
		}
	}
}

// TestDecodedIDKeptOnNATSToNATS: a Kafka task id that nats.go would alter
// (a trailing space) reaches a NATS target percent-encoded; republished as
// it arrived to a NATS delay subject, for a NATS target, the next hop's
// task has the decoded id, which must again arrive encoded: sent as it is,
// nats.go trims it, and the delivery's delay-id ("job-7") is another
// task's, which the consumer's dedup on (delay-id, delay-due) confuses
// with it and which a cancel or GET of the id it names misses.
func TestDecodedIDKeptOnNATSToNATS(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	e.publishKafka(0, time.Time{}, []byte("job-7 "), []byte("hop"), "retry-count", "0", "delay-after", "0", "delay-target", "nats:orders.p")
	ds := e.advanceUntil("hop 0", func(ds []delivery) bool { return len(byValue(ds, "orders.p")["hop"]) > 0 })
	h0 := byValue(ds, "orders.p")["hop"][0]
	e.publishNATS("delay.x", []byte("hop"), asIs(h0, "retry-count", "1", "delay-after", "0", "delay-target", "orders.p")...)
	ds = e.advanceUntil("hop 1", func(ds []delivery) bool { return len(byValue(ds, "orders.p")["hop"]) > 1 })
	checkHopIDs(t, byValue(ds, "orders.p")["hop"], "job-7 ")
}
