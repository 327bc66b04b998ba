package service

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
)

// User journeys (hunt H165): a consumer's retry-with-backoff chain, which
// republishes the message it received to the delay source with the same
// delay-id and a doubled delay-after, and an operator's replay of dead
// letters after fixing their cause.

// asIs is the pairs of a received message's headers with the names in set
// replaced (or added): a consumer republishing what it received.
func asIs(d delivery, set ...string) []string {
	var out []string
next:
	for _, h := range d.headers {
		for i := 0; i+1 < len(set); i += 2 {
			if strings.EqualFold(h.Key, set[i]) {
				continue next
			}
		}
		out = append(out, h.Key, string(h.Value))
	}
	return append(out, set...)
}

// headerValues is every value of a header, in any case.
func headerValues(d delivery, k string) []string {
	var out []string
	for _, h := range d.headers {
		if strings.EqualFold(h.Key, k) {
			out = append(out, string(h.Value))
		}
	}
	return out
}

// checkHop checks a delivered hop of a chain: the id, the user's headers
// once each, the bridge's added headers once each, no control header.
func checkHop(t *testing.T, d delivery, id string, hop int) {
	t.Helper()
	want := map[string]string{"x-user": "tenant-7", "retry-count": strconv.Itoa(hop), codec.HeaderID: id}
	for k, v := range want {
		if got := headerValues(d, k); len(got) != 1 || got[0] != v {
			t.Errorf("%s hop %d: %s = %q, want [%s] (headers %v)", id, hop, k, got, v, d.headers)
		}
	}
	for _, k := range []string{codec.HeaderOrigin, codec.HeaderDue} {
		if got := headerValues(d, k); len(got) != 1 {
			t.Errorf("%s hop %d: %s = %q, want one value", id, hop, k, got)
		}
	}
	for _, k := range []string{codec.HeaderAt, codec.HeaderAfter, codec.HeaderTarget, codec.HeaderKey, codec.HeaderCancel} {
		if got := headerValues(d, k); len(got) != 0 {
			t.Errorf("%s hop %d: control header %s = %q delivered", id, hop, k, got)
		}
	}
}

// hopsOf is the deliveries of chain id, by their retry-count.
func hopsOf(ds []delivery, id string) map[int][]delivery {
	out := map[int][]delivery{}
	for _, d := range ds {
		if d.header(codec.HeaderID) != id {
			continue
		}
		n, _ := strconv.Atoi(d.header("retry-count"))
		out[n] = append(out[n], d)
	}
	return out
}

// TestRetryChainRepublishAsIs: a consumer that republishes the message it
// received, headers and all, with a new delay-after (doubling) and
// delay-target keeps its chain: the delivered message carries delay-id (the
// only control header it has), so each hop replaces nothing and has the
// chain's id; no stale control header of an earlier hop comes back; the
// user's headers arrive once, and the bridge's delay-origin and delay-due
// once (the republished copies are replaced). On Kafka, with the fake
// clock as broker time, each hop is due exactly delay-after after its
// republish. Chains: Kafka only, NATS only, and crossing at each hop.
func TestRetryChainRepublishAsIs(t *testing.T) {
	e := newEnv(t, "")
	svc, _ := e.start()
	const hops = 4
	after := func(hop int) string { return strconv.Itoa(1<<hop) + "s" }
	first := []string{"x-user", "tenant-7", "retry-count", "0"}

	e.publishKafka(0, time.Time{}, []byte("job-A"), []byte("A"), append(first, "delay-after", after(0), "delay-target", kafkaOut)...)
	e.publishNATS("delay.retry", []byte("B"), append(first, "delay-id", "job-B", "delay-after", after(0), "delay-target", "orders.retry")...)
	e.publishKafka(1, time.Time{}, []byte("job-C"), []byte("C"), append(first, "delay-after", after(0), "delay-target", "nats:orders.cross")...)
	sentAt := map[string]time.Time{"job-A": e.clk.Now()}

	for hop := 0; hop < hops; hop++ {
		ds := e.advanceUntil("hop "+strconv.Itoa(hop), func(ds []delivery) bool {
			for _, id := range []string{"job-A", "job-B", "job-C"} {
				if len(hopsOf(ds, id)[hop]) == 0 {
					return false
				}
			}
			return true
		})
		for _, id := range []string{"job-A", "job-B", "job-C"} {
			d := hopsOf(ds, id)[hop][0]
			checkHop(t, d, id, hop)
			if id == "job-A" {
				if want := codec.FormatDue(sentAt[id].Add(time.Duration(1<<hop) * time.Second).UnixMilli()); d.header(codec.HeaderDue) != want {
					t.Errorf("job-A hop %d due %s, want %s (republished at %v + %s)", hop, d.header(codec.HeaderDue), want, sentAt[id], after(hop))
				}
			}
			if hop+1 == hops {
				continue
			}
			next := asIs(d, "retry-count", strconv.Itoa(hop+1), "delay-after", after(hop+1))
			switch {
			case id == "job-A":
				sentAt[id] = e.clk.Now()
				e.publishKafka(0, sentAt[id], []byte(d.key), []byte(d.value), append(next, "delay-target", kafkaOut)...)
			case id == "job-B":
				e.publishNATS("delay.retry", []byte(d.value), append(next, "delay-target", "orders.retry")...)
			case d.transport == "nats": // job-C: back across to Kafka, from NATS
				e.publishNATS("delay.cross", []byte(d.value), append(next, "delay-target", "kafka:"+kafkaOut)...)
			default:
				e.publishKafka(1, time.Time{}, []byte(d.key), []byte(d.value), append(next, "delay-target", "nats:orders.cross")...)
			}
		}
	}
	// Sentinels after the last hops, on the same Kafka partitions and
	// NATS stream: once they are read, any extra copy of a hop would be.
	e.publishKafka(0, time.Time{}, []byte("job-A"), []byte("end-0"), "delay-id", "end-0", "delay-after", "0", "delay-target", kafkaOut)
	e.publishKafka(1, time.Time{}, []byte("job-C"), []byte("end-1"), "delay-id", "end-1", "delay-after", "0", "delay-target", kafkaOut)
	e.publishNATS("delay.end", []byte("end-n"), "delay-after", "0", "delay-target", "orders.end")
	ds := e.advanceUntil("the sentinels", func(ds []delivery) bool {
		v := byValue(ds, "")
		return len(v["end-0"]) > 0 && len(v["end-1"]) > 0 && len(v["end-n"]) > 0
	})
	e.settle(svc)
	for _, id := range []string{"job-A", "job-B", "job-C"} {
		got := hopsOf(ds, id)
		for hop := 0; hop < hops; hop++ {
			if n := len(got[hop]); n != 1 {
				t.Errorf("%s hop %d delivered %d times, want once", id, hop, n)
			}
		}
		if len(got) != hops {
			t.Errorf("%s: hops %v delivered, want 0..%d", id, got, hops-1)
		}
	}
	// The cross chain alternates transports.
	for hop, d := range hopsOf(ds, "job-C") {
		if want := map[bool]string{true: "nats", false: "kafka"}[hop%2 == 0]; d[0].transport != want {
			t.Errorf("job-C hop %d went to %s, want %s", hop, d[0].transport, want)
		}
	}
}

// TestRetryChainHopReplacesUnacknowledgedDelivery: the consumer receives
// hop N although the bridge's publish of it failed (the partition wrote it
// and answered NOT_ENOUGH_REPLICAS_AFTER_APPEND), and republishes hop N+1
// with the same id while hop N waits for its retry. The republish replaces
// hop N: it is not published again (the copies already written share
// delay-id and delay-due, for the consumer's dedup), and hop N+1 is
// delivered once, at its own due time.
func TestRetryChainHopReplacesUnacknowledgedDelivery(t *testing.T) {
	e := newEnv(t, "shards: 1\n")
	svc, _ := e.start()
	fault := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaOut, Err: kerr.NotEnoughReplicasAfterAppend, Count: -1})
	e.publishKafka(0, time.Time{}, []byte("job"), []byte("v"), "x-user", "tenant-7", "retry-count", "0", "delay-after", "1s", "delay-target", kafkaOut)
	waitIngested(t, svc, 1)
	e.clk.Advance(time.Second)
	ds := e.waitFor("hop 0 written", func(ds []delivery) bool { return len(hopsOf(ds, "job")[0]) > 0 })
	eventually(t, "hop 0 waiting for its retry", func() bool {
		info, err := svc.Engine().Lookup(kafkaDelay, "job")
		return err == nil && (info.Held || info.NextFire.After(e.clk.Now()))
	})
	hop0 := hopsOf(ds, "job")[0][0]
	checkHop(t, hop0, "job", 0)

	// The consumer's republish, while hop 0 waits for its retry.
	sent := e.clk.Now()
	e.publishKafka(0, sent, []byte(hop0.key), []byte(hop0.value), append(asIs(hop0, "retry-count", "1", "delay-after", "2s"), "delay-target", kafkaOut)...)
	eventually(t, "hop 1 replacing hop 0", func() bool {
		info, err := svc.Engine().Lookup(kafkaDelay, "job")
		return err == nil && info.Due.Equal(time.UnixMilli(sent.Add(2*time.Second).UnixMilli()))
	})
	fault.Remove()
	e.advance(svc, 10*time.Second, 500*time.Millisecond)
	e.publishKafka(0, time.Time{}, []byte("job"), []byte("end"), "delay-id", "end", "delay-after", "0", "delay-target", kafkaOut)
	ds = e.advanceUntil("the sentinel", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["end"]) > 0 })

	got := hopsOf(ds, "job")
	for _, d := range got[0] {
		if d.header(codec.HeaderDue) != hop0.header(codec.HeaderDue) {
			t.Errorf("a copy of hop 0 due %s, the first %s: not one delivery for the consumer's dedup", d.header(codec.HeaderDue), hop0.header(codec.HeaderDue))
		}
	}
	if n := len(got[1]); n != 1 {
		t.Fatalf("hop 1 delivered %d times, want once", n)
	}
	checkHop(t, got[1][0], "job", 1)
	if want := codec.FormatDue(sent.Add(2 * time.Second).UnixMilli()); got[1][0].header(codec.HeaderDue) != want {
		t.Errorf("hop 1 due %s, want %s", got[1][0].header(codec.HeaderDue), want)
	}
	t.Logf("hop 0 written %d times (kafka-go's attempts within the failed try)", len(got[0]))
}

// replayHeaders is the README's replay recipe applied to a dead letter's
// headers: delay-error and delay-error-detail taken out (the bridge would
// deliver them: they are not control headers), the target set, and for a
// dead letter made at the due time (publish-failed: no delay-at or
// delay-after left) delay-at set to its delay-due, so it fires at once and
// arrives with the (delay-id, delay-due) of the task that failed, which a
// consumer dedups on. A dead letter without a delay-id (a keyless Kafka
// message; on NATS, one without delay-id) gets its delay-origin as
// delay-id, so a second replay replaces the first while it is pending.
func replayHeaders(d delivery, target string) []string {
	var out []string
	id, origin, due, scheduled := "", "", "", false
	for _, h := range d.headers {
		switch strings.ToLower(h.Key) {
		case codec.HeaderError, codec.HeaderErrorDetail, codec.HeaderTarget:
			continue
		case codec.HeaderAt, codec.HeaderAfter:
			scheduled = true
		case codec.HeaderID:
			id = string(h.Value)
		case codec.HeaderOrigin:
			origin = string(h.Value)
		case codec.HeaderDue:
			due = string(h.Value)
		}
		out = append(out, h.Key, string(h.Value))
	}
	out = append(out, codec.HeaderTarget, target)
	if !scheduled { // made at the due time: no control headers left
		out = append(out, codec.HeaderAt, due)
	}
	if id == "" && (d.transport == "nats" || d.key == "") {
		out = append(out, codec.HeaderID, origin)
	}
	return out
}

// TestDeadLetterReplay: dead letters read from the DLQ and published again
// to the delay source after the cause was fixed, as README's "Replaying
// dead letters" says: a bad-target typo (made at ingest: the message
// unchanged, its control headers kept) with the target corrected, and a
// publish-failed one (the task as it would have been delivered) with a
// target that works. Each arrives at the right target with its id, its
// user headers and no delay-error; a past due fires at once with its
// original delay-due; a replay published twice while pending is one task.
func TestDeadLetterReplay(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2}\n")
	svc, _ := e.start()
	now := e.clk.Now()
	at := func(d time.Duration) string { return now.Add(d).UTC().Format(time.RFC3339Nano) }

	e.publishKafka(0, now, []byte("job-K1"), []byte("K1"), "x-user", "u1", "delay-at", at(2*time.Second), "delay-target", "kafak:orders")
	e.publishKafka(0, now, []byte("job-K2"), []byte("K2"), "x-user", "u2", "delay-at", at(time.Hour), "delay-target", "kafak:orders")
	e.publishKafka(1, now, nil, []byte("K3"), "x-user", "u3", "delay-after", "1h", "delay-target", "orders x")
	e.publishKafka(2, now, []byte("job-K4"), []byte("K4"), "x-user", "u4", "delay-after", "1s", "delay-target", "missing-topic")
	e.publishNATS("delay.r", []byte("N1"), "x-user", "n1", "delay-id", "job-N1", "delay-at", at(2*time.Second), "delay-target", "orders..r")
	e.publishNATS("delay.r", []byte("N2"), "x-user", "n2", "delay-id", "job-N2", "delay-after", "1s", "delay-target", "nostream.r")

	dead := e.advanceUntil("six dead letters", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }) >= 6
	})
	e.advance(svc, 5*time.Second, time.Second) // K1's and N1's delay-at passed
	targets := map[string]string{"K1": kafkaOut, "K2": kafkaOut, "K3": kafkaOut, "K4": kafkaOut, "N1": "orders.r", "N2": "orders.r"}
	dues := map[string]string{}
	for _, d := range dead {
		if d.dest != kafkaDLQ && d.dest != "dlq.delay" {
			continue
		}
		hs := replayHeaders(d, targets[d.value])
		dues[d.value] = d.header(codec.HeaderDue)
		for range 2 { // an operator's replay run twice
			if d.transport == "kafka" {
				var key []byte
				if d.key != "" {
					key = []byte(d.key)
				}
				e.publishKafka(0, time.Time{}, key, []byte(d.value), hs...)
			} else {
				e.publishNATS("delay.r", []byte(d.value), hs...)
			}
		}
	}
	// K2 and K3 are pending: one task each, however many replays.
	k3 := one(t, byValue(dead, kafkaDLQ), "K3").header(codec.HeaderOrigin)
	waitStored(t, svc, 2, kafkaDelay, "job-K2", k3)
	e.waitFor("the overdue replays", func(ds []delivery) bool {
		v := byValue(ds, "")
		return len(v["K1"]) > 0 && len(v["K4"]) > 0 && len(v["N1"]) > 0 && len(v["N2"]) > 0
	})
	e.advance(svc, time.Hour, 10*time.Minute)
	ds := e.waitFor("the pending replays", func(ds []delivery) bool {
		v := byValue(ds, kafkaOut)
		return len(v["K2"]) > 0 && len(v["K3"]) > 0
	})
	e.settle(svc)

	want := map[string]struct{ id, due, user string }{
		"K1": {"job-K1", codec.FormatDue(now.Add(2 * time.Second).UnixMilli()), "u1"},
		"K2": {"job-K2", codec.FormatDue(now.Add(time.Hour).UnixMilli()), "u2"},
		"K3": {k3, "", "u3"},
		"K4": {"job-K4", dues["K4"], "u4"},
		"N1": {"job-N1", codec.FormatDue(now.Add(2 * time.Second).UnixMilli()), "n1"},
		"N2": {"job-N2", dues["N2"], "n2"},
	}
	for v, w := range want {
		got := byValue(ds, targets[v])[v]
		if len(got) == 0 {
			t.Errorf("%s: not delivered to %s", v, targets[v])
			continue
		}
		for _, d := range got {
			if d.header(codec.HeaderID) != w.id || (w.due != "" && d.header(codec.HeaderDue) != w.due) || d.header("x-user") != w.user ||
				len(headerValues(d, codec.HeaderError)) != 0 || len(headerValues(d, codec.HeaderErrorDetail)) != 0 {
				t.Errorf("%s delivered with id %q due %q x-user %q, want %q %q %q and no delay-error (headers %v)", v,
					d.header(codec.HeaderID), d.header(codec.HeaderDue), d.header("x-user"), w.id, w.due, w.user, d.headers)
			}
		}
	}
	for _, v := range []string{"K2", "K3"} {
		if n := len(byValue(ds, kafkaOut)[v]); n != 1 {
			t.Errorf("%s replayed twice while pending, delivered %d times, want once", v, n)
		}
	}
}

// TestNATSDeadLettersOfOneIDAndDueBothStored: two messages of a NATS
// source with the same delay-id and due time both fail for good (a
// publish-failed dead letter replayed with its delay-at, payload edited,
// to a target that still refuses it). Both dead letters must reach the
// NATS DLQ: they are distinct messages (another origin, another value),
// not a redelivery of one. With the DLQ's Nats-Msg-Id made of the task id
// and due, as a delivery's, the DLQ stream's duplicate window (2 min by
// default) dropped the second while its PubAck said it was stored, so the
// bridge deleted it: the edited copy was in neither the store nor the DLQ.
func TestNATSDeadLettersOfOneIDAndDueBothStored(t *testing.T) {
	e := newEnv(t, "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 1}\n")
	svc, _ := e.start()
	due := e.clk.Now().Add(time.Second).UTC().Format(time.RFC3339Nano)
	e.publishNATS("delay.r", []byte("v1"), "delay-id", "job-R", "delay-at", due, "delay-target", "nostream.r")
	e.advanceUntil("the first dead letter", func(ds []delivery) bool { return len(byValue(ds, "dlq.delay")["v1"]) > 0 })
	e.publishNATS("delay.r", []byte("v2"), "delay-id", "job-R", "delay-at", due, "delay-target", "nostream.r")
	// Overdue when taken in, so it may be stored, refused and dead-lettered
	// before a poll of the pending count would see it: wait for its dead
	// letter (the sink deduplicated away never arrives), then for its
	// delete.
	e.advanceUntil("the second dead letter", func(ds []delivery) bool { return len(byValue(ds, "dlq.delay")["v2"]) > 0 })
	eventually(t, "the second task gone from the store", func() bool { return svc.Engine().Stats().Pending == 0 })
	// Deleted from the store only after the DLQ's PubAck: the stream
	// holds what it took.
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(context.Background(), "DLQ")
	if err != nil {
		t.Fatal(err)
	}
	if n := st.CachedInfo().State.Msgs; n != 2 {
		t.Fatalf("the DLQ stream holds %d messages, want both dead letters", n)
	}
	ds := e.waitFor("both dead letters", func(ds []delivery) bool { return len(byValue(ds, "dlq.delay")["v2"]) > 0 })
	if n := len(byValue(ds, "dlq.delay")["v1"]); n != 1 {
		t.Fatalf("first dead letter in the DLQ %d times, want once", n)
	}
}
