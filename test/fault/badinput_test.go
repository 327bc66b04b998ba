package fault

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/codec"
)

// badCase is one message of the corpus: the headers (besides x-id) and the
// value, and the dead-letter code it must get ("" = it is good and must be
// delivered to its target).
type badCase struct {
	name    string
	code    codec.Code
	headers []string
	value   []byte
	kafka   bool // only on Kafka (tombstones, Kafka-only targets)
	noKey   bool
	// natsAlt is also accepted on NATS: a subject may hold any bytes but
	// white space, so invalid UTF-8 there is a legal subject that
	// targets.allow then refuses.
	natsAlt codec.Code
}

const badMaxBytes = 64 << 10

// corpus returns the bad-input cases; now anchors absolute due times.
func corpus(now time.Time) []badCase {
	at := func(d time.Duration) string { return now.Add(d).UTC().Format(time.RFC3339Nano) }
	oneMB := strings.Repeat("h", 1_000_000)
	return []badCase{
		{name: "missing-due", code: codec.CodeMissingDue, headers: []string{"delay-target", "orders"}},
		{name: "ambiguous-due", code: codec.CodeAmbiguousDue, headers: []string{"delay-after", "1s", "delay-at", at(time.Second), "delay-target", "orders"}},
		{name: "bad-due-word", code: codec.CodeBadDue, headers: []string{"delay-after", "soon", "delay-target", "orders"}},
		{name: "bad-due-negative", code: codec.CodeBadDue, headers: []string{"delay-after", "-5s", "delay-target", "orders"}},
		{name: "bad-due-utf8", code: codec.CodeBadDue, headers: []string{"delay-after", "\xff\xfe1s", "delay-target", "orders"}},
		{name: "too-long-days-overflow", code: codec.CodeDelayTooLong, headers: []string{"delay-after", "99999999999999d", "delay-target", "orders"}},
		{name: "too-long-ms-overflow", code: codec.CodeDelayTooLong, headers: []string{"delay-after", "99999999999999999999999", "delay-target", "orders"}},
		{name: "too-long-ms-after-9999", code: codec.CodeDelayTooLong, headers: []string{"delay-after", "9000000000000000", "delay-target", "orders"}},
		{name: "bad-due-epoch-year-10000", code: codec.CodeBadDue, headers: []string{"delay-at", "253402300800000", "delay-target", "orders"}},
		{name: "bad-due-epoch-before-1970", code: codec.CodeBadDue, headers: []string{"delay-at", "-1000", "delay-target", "orders"}},
		{name: "bad-due-rfc3339-before-1970", code: codec.CodeBadDue, headers: []string{"delay-at", "1969-12-31T23:59:59Z", "delay-target", "orders"}},
		{name: "bad-due-no-offset", code: codec.CodeBadDue, headers: []string{"delay-at", "2026-11-22T15:04:05", "delay-target", "orders"}},
		{name: "bad-due-cancel-maybe", code: codec.CodeBadDue, headers: []string{"delay-cancel", "maybe", "delay-id", "x"}},
		{name: "too-long-rfc3339-year-9999", code: codec.CodeDelayTooLong, headers: []string{"delay-at", "9999-12-31T23:59:59Z", "delay-target", "orders"}},
		{name: "too-long-epoch-year-9999", code: codec.CodeDelayTooLong, headers: []string{"delay-at", "253402214400000", "delay-target", "orders"}},
		{name: "too-long-31d", code: codec.CodeDelayTooLong, headers: []string{"delay-after", "31d", "delay-target", "orders"}},
		{name: "missing-target", code: codec.CodeMissingTarget, headers: []string{"delay-after", "1s"}},
		{name: "bad-target-space", code: codec.CodeBadTarget, headers: []string{"delay-after", "1s", "delay-target", "no spaces!"}},
		{name: "bad-target-utf8", code: codec.CodeBadTarget, headers: []string{"delay-after", "1s", "delay-target", "orders\xff\xfe"}, natsAlt: codec.CodeTargetNotAllowed},
		{name: "bad-target-transport", code: codec.CodeBadTarget, headers: []string{"delay-after", "1s", "delay-target", "smtp:orders"}},
		{name: "not-allowed", code: codec.CodeTargetNotAllowed, headers: []string{"delay-after", "1s", "delay-target", "payments"}},
		{name: "too-large-value", code: codec.CodeTooLarge, headers: []string{"delay-after", "1s", "delay-target", "orders"}, value: make([]byte, badMaxBytes+1)},
		// JetStream refuses headers over 64 KiB at publish, so 1 MB headers are Kafka only.
		{name: "too-large-1mb-header", code: codec.CodeTooLarge, headers: []string{"delay-after", "1s", "delay-target", "orders", "x-big", oneMB}, kafka: true},
		{name: "too-large-60k-header", code: codec.CodeTooLarge, headers: []string{"delay-after", "1s", "delay-target", "orders", "x-big", oneMB[:60_000]}, value: make([]byte, 10_000)},
		{name: "publish-failed", code: codec.CodePublishFailed, headers: []string{"delay-after", "0", "delay-target", "missing-topic"}, kafka: true},
		{name: "tombstone-without-key", code: codec.CodeMissingDue, kafka: true, noKey: true},
		// Good ones with odd but legal input: delivered to the target.
		{name: "good-utf8-header-value", headers: []string{"delay-after", "0", "delay-target", "orders", "x-bin", "\xff\xfe\x01ok"}},
		{name: "good-past-epoch", headers: []string{"delay-at", "1", "delay-target", "orders"}},
		{name: "good-year-1970", headers: []string{"delay-at", "1970-01-01T00:00:00.001Z", "delay-target", "orders"}},
	}
}

// TestBadInput sends the corpus through the real brokers into the shipped
// binary, interleaved with good messages, on both transports: every bad
// message must reach its source's DLQ with the right code, every good one
// its target, and no partition may stall. Messages over the broker's own
// limit must be refused at publish without disturbing anything.
func TestBadInput(t *testing.T) {
	t.Parallel()
	nBad := 1000
	if long() {
		nBad = 10_000
	}
	b := newBrokers(t, 4<<20) // NATS max_payload 4 MiB so 1 MB headers get through
	col := b.collect(t)
	r := newRunner(t, b, bridgeConfig{
		maxBytes: badMaxBytes,
		allow:    `["orders", "orders.>", "kafka:orders", "nats:orders.>", "missing-topic"]`,
		retry:    "{initial: 100ms, max: 200ms, multiplier: 2, jitter: 0.1, max_attempts: 2}",
	})
	p := r.start()
	p.waitLog(90*time.Second, "delaybridge running")

	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 3))
	kcl := b.kafkaClient()
	defer kcl.Close()
	nc := b.natsConn()
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(1<<20))
	if err != nil {
		t.Fatal(err)
	}

	// Over the broker limits: refused at publish, nothing else affected.
	// Random bytes: the producer compresses, and the broker checks the
	// compressed batch.
	huge := make([]byte, 3<<20)
	for i := range huge {
		huge[i] = byte(rng.Uint32())
	}
	big := b.kafkaClient(kgo.ProducerBatchMaxBytes(16 << 20)) // let the broker, not the client, refuse it
	defer big.Close()
	if err := big.ProduceSync(ctx, kafkaRecord(0, []byte("huge"), huge, hdr("delay-after", "0", "delay-target", "orders", "x-id", "huge-kafka"))).FirstErr(); err == nil {
		t.Error("kafka accepted a 3 MiB record; the broker limit should refuse it")
	} else {
		t.Logf("kafka refused a 3 MiB record at publish: %v", err)
	}
	if _, err := js.PublishMsg(ctx, natsMsg("delay.bad", make([]byte, 5<<20), hdr("delay-after", "0", "delay-target", "orders.x", "x-id", "huge-nats"))); err == nil {
		t.Error("nats accepted a 5 MiB message over max_payload")
	} else {
		t.Logf("nats refused a 5 MiB message at publish: %v", err)
	}

	cases := corpus(time.Now())
	want := map[string]badCase{} // x-id -> case
	var futures []func() error
	sent := 0
	for i := 0; sent < nBad; i++ {
		c := cases[i%len(cases)]
		for _, tr := range []string{"kafka", "nats"} {
			if c.kafka && tr == "nats" {
				continue
			}
			id := fmt.Sprintf("%s-%s-%d", tr, c.name, i)
			want[id] = c
			if c.code != "" {
				sent++
			}
			good := fmt.Sprintf("%s-good-%d", tr, i)
			target := "orders"
			if tr == "nats" {
				target = "orders.good"
			}
			if i%3 == 0 { // cross transport
				target = map[string]string{"kafka": "nats:orders.cross", "nats": "kafka:orders"}[tr]
			}
			want[good] = badCase{name: "good"}
			goodHS := hdr("delay-after", strconv.Itoa(rng.IntN(500)), "delay-target", target, "x-id", good)
			hs := hdr(append(append([]string{}, c.headers...), "x-id", id)...)
			value := c.value
			if value == nil && !(c.noKey) {
				value = []byte(id)
			}
			if tr == "kafka" {
				key := []byte(id)
				if c.noKey {
					key = nil
				}
				part := int32(i % 3)
				futures = append(futures, produce(kcl, kafkaRecord(part, key, value, hs)), produce(kcl, kafkaRecord(part, []byte(good), []byte(good), goodHS)))
			} else {
				if c.name == "good-utf8-header-value" { // NATS headers are text lines: no control bytes
					hs = hdr("delay-after", "0", "delay-target", "orders.x", "x-bin", "\xff\xfeok", "x-id", id)
				}
				futures = append(futures, publishAsync(js, natsMsg("delay.bad", value, natsTargets(hs))),
					publishAsync(js, natsMsg("delay.good", []byte(good), goodHS)))
			}
		}
	}
	for _, f := range futures {
		if err := f(); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
	t.Logf("published %d bad and %d good messages", sent, len(want)-sent)

	byID := func() map[string][]delivery {
		out := map[string][]delivery{}
		for _, ds := range col.byValue(func(delivery) bool { return true }) {
			for _, d := range ds {
				out[d.headers["x-id"]] = append(out[d.headers["x-id"]], d)
			}
		}
		return out
	}
	var got map[string][]delivery
	missing := 0
	waitFor(2*time.Minute, func() bool {
		got = byID()
		missing = 0
		for id := range want {
			if len(got[id]) == 0 {
				missing++
			}
		}
		return missing == 0
	})
	if !p.running() {
		t.Errorf("bridge exited: %v", p.err)
	}
	if missing > 0 {
		n := 0
		for id := range want {
			if len(got[id]) == 0 && n < 10 {
				t.Errorf("%s never arrived (code %q)", id, want[id].code)
				n++
			}
		}
		t.Fatalf("%d of %d messages missing", missing, len(want))
	}
	wrong := 0
	codes := map[codec.Code]int{}
	for id, c := range want {
		d := got[id][0]
		tr := strings.SplitN(id, "-", 2)[0]
		if c.code == "" {
			if !isTarget(d) {
				wrong++
				if wrong < 10 {
					t.Errorf("%s: good message went to %s (%s: %s)", id, d.dest, d.headers["delay-error"], d.headers["delay-error-detail"])
				}
			}
			if c.name == "good-utf8-header-value" && tr == "kafka" && d.headers["x-bin"] != "\xff\xfe\x01ok" {
				t.Errorf("%s: header bytes changed to %q", id, d.headers["x-bin"])
			}
			continue
		}
		codes[c.code]++
		wantDLQ := map[string]string{"kafka": kafkaDLQ, "nats": natsDLQ}[tr]
		code := d.headers["delay-error"]
		if tr == "nats" && c.natsAlt != "" && code == string(c.natsAlt) {
			code = string(c.code)
		}
		if d.dest != wantDLQ || code != string(c.code) || d.headers["delay-error-detail"] == "" || d.headers["delay-origin"] == "" {
			wrong++
			if wrong < 20 {
				t.Errorf("%s: got dest %s code %q detail %q origin %q; want %s code %s", id, d.dest,
					d.headers["delay-error"], d.headers["delay-error-detail"], d.headers["delay-origin"], wantDLQ, c.code)
			}
		}
		if c.name == "too-large-1mb-header" && len(d.headers["x-big"]) != 1_000_000 {
			t.Errorf("%s: dead letter's 1 MB header has %d bytes", id, len(d.headers["x-big"]))
		}
	}
	t.Logf("dead letters by code: %v; %d wrong", codes, wrong)
	if err := p.term(); err != nil {
		t.Errorf("bridge stop: %v", err)
	}
}

// natsTargets rewrites the bare Kafka target "orders" of the shared corpus
// to a subject of the NATS ORDERS stream.
func natsTargets(hs []codec.Header) []codec.Header {
	out := make([]codec.Header, len(hs))
	for i, h := range hs {
		out[i] = h
		if strings.EqualFold(h.Key, "delay-target") && string(h.Value) == "orders" {
			out[i].Value = []byte("orders.x")
		}
	}
	return out
}

func produce(cl *kgo.Client, r *kgo.Record) func() error {
	done := make(chan error, 1)
	cl.Produce(context.Background(), r, func(_ *kgo.Record, err error) { done <- err })
	return func() error { return <-done }
}

func publishAsync(js jetstream.JetStream, m *natsgo.Msg) func() error {
	f, err := js.PublishMsgAsync(m)
	if err != nil {
		return func() error { return err }
	}
	return func() error {
		select {
		case <-f.Ok():
			return nil
		case err := <-f.Err():
			return err
		case <-time.After(time.Minute):
			return fmt.Errorf("publish %s: no ack within a minute", m.Subject)
		}
	}
}
