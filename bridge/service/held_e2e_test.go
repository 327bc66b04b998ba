package service

import (
	"context"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
)

const heldRetryCfg = "retry: {initial: 1s, max: 2s, multiplier: 2, jitter: 0, max_attempts: 2, waiting_in_memory: 0}\n"

// advanceUntilCond is advanceUntil for a condition on anything but the
// deliveries.
func advanceUntilCond(t *testing.T, e *env, what string, cond func() bool) {
	t.Helper()
	e.advanceUntil(what, func([]delivery) bool { return cond() })
}

// checkOnce checks that each value in want reached dest exactly once, with
// its contract headers.
func checkOnce(t *testing.T, got []delivery, dest string, want []string) {
	t.Helper()
	bv := byValue(got, dest)
	for _, v := range want {
		ds := bv[v]
		if len(ds) != 1 {
			t.Errorf("%s: %q delivered %d times, want 1", dest, v, len(ds))
			continue
		}
		d := ds[0]
		if d.header("delay-id") == "" || d.header("delay-origin") == "" || d.header("delay-due") == "" {
			t.Errorf("%s: %q lacks delay-id/origin/due: %+v", dest, v, d.headers)
		}
		if d.header("delay-target") != "" || d.header("delay-after") != "" {
			t.Errorf("%s: %q carries control headers: %+v", dest, v, d.headers)
		}
		if !strings.HasPrefix(d.header("x-h"), "v") {
			t.Errorf("%s: %q lost header x-h: %+v", dest, v, d.headers)
		}
	}
}

// Both target brokers down at once, all four source->target combinations
// held; the bridge restarts with both still down; then both come back.
func TestHeldE2EBothDownRestart(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, stop := e.start()
	fail := e.failProduceTo(kafkaOut)
	const n = 10
	var kk, kn, nn, nk []string
	for i := range n {
		s := strconv.Itoa(i)
		kk, kn, nn, nk = append(kk, "kk"+s), append(kn, "kn"+s), append(nn, "nn"+s), append(nk, "nk"+s)
		e.publishKafka(int32(i%3), time.Time{}, []byte("kk"+s), []byte("kk"+s), "delay-after", "2s", "delay-target", "orders", "x-h", "v"+s)
		e.publishKafka(int32(i%3), time.Time{}, []byte("kn"+s), []byte("kn"+s), "delay-after", "2s", "delay-target", "nats:orders.kn", "x-h", "v"+s)
		e.publishNATS("delay.a", []byte("nn"+s), "delay-after", "2s", "delay-target", "orders.nn", "x-h", "v"+s, "delay-id", "nn"+s)
		e.publishNATS("delay.a", []byte("nk"+s), "delay-after", "2s", "delay-target", "kafka:orders", "delay-key", "nk"+s, "x-h", "v"+s)
	}
	waitIngested(t, svc, 4*n)
	fail.Store(true)
	e.ns.Shutdown()
	advanceUntilCond(t, e, "all held", func() bool { return svc.Engine().Stats().Held == 4*n })
	if ti, err := svc.Engine().Lookup("DELAY", "nn3"); err != nil || !ti.Held || !ti.NextFire.IsZero() {
		t.Fatalf("lookup of a held task: %+v, %v", ti, err)
	}
	if svc.Ready() == nil {
		t.Fatal("ready during the outage")
	}
	stop()
	svc, _ = e.start()
	if st := svc.Engine().Stats(); st.Held != 4*n || st.Pending != 4*n {
		t.Fatalf("after restart: pending %d held %d", st.Pending, st.Held)
	}
	for range 10 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	if got := countDest(e.deliveries(), func(d delivery) bool { return d.dest != "" }); got != 0 {
		t.Fatalf("%d delivered while down", got)
	}
	if st := svc.Engine().Stats(); st.Held != 4*n || st.Pending != 4*n {
		t.Fatalf("after restart, still down: pending %d held %d", st.Pending, st.Held)
	}
	fail.Store(false)
	e.startNATS()
	e.advanceUntil("all delivered", func(ds []delivery) bool {
		return len(byValue(ds, kafkaOut)) >= 2*n && len(byValue(ds, "orders.kn")) >= n && len(byValue(ds, "orders.nn")) >= n
	})
	for range 5 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	got := e.deliveries()
	checkOnce(t, got, kafkaOut, append(kk, nk...))
	checkOnce(t, got, "orders.kn", kn)
	checkOnce(t, got, "orders.nn", nn)
	if dl := countDest(got, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }); dl != 0 {
		t.Errorf("%d dead letters", dl)
	}
	for _, d := range byValue(got, kafkaOut) {
		if d[0].key != d[0].value {
			t.Errorf("key %q for %q", d[0].key, d[0].value)
		}
	}
	eventually(t, "nothing pending or held", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
	_ = codec.HeaderError
}

// Held tasks and a restart that narrows targets.allow: dead-lettered
// target-not-allowed, not held forever.
func TestHeldE2EAllowNarrowed(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, stop := e.start()
	fail := e.failProduceTo(kafkaOut)
	fail.Store(true)
	e.publishKafka(0, time.Time{}, []byte("ka"), []byte("ka"), "delay-after", "1s", "delay-target", "orders")
	e.publishNATS("delay.a", []byte("na"), "delay-after", "1s", "delay-target", "kafka:orders", "delay-id", "na")
	waitIngested(t, svc, 2)
	advanceUntilCond(t, e, "held", func() bool { return svc.Engine().Stats().Held == 2 })
	stop()
	e.mutate = func(c *config.Config) { c.Targets.Allow = []string{"nats:orders.>"} }
	svc, _ = e.start()
	got := e.advanceUntil("dead letters", func(ds []delivery) bool {
		return len(byValue(ds, kafkaDLQ)["ka"]) > 0 && len(byValue(ds, "dlq.delay")["na"]) > 0
	})
	for _, d := range []delivery{byValue(got, kafkaDLQ)["ka"][0], byValue(got, "dlq.delay")["na"][0]} {
		if c := d.header(codec.HeaderError); c != string(codec.CodeTargetNotAllowed) {
			t.Errorf("%s: delay-error %q", d.value, c)
		}
	}
	eventually(t, "nothing pending or held", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
}

// Held tasks and a restart that removes the NATS transport.
func TestHeldE2ETransportRemoved(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, stop := e.start()
	e.publishKafka(0, time.Time{}, []byte("kx"), []byte("kx"), "delay-after", "1s", "delay-target", "nats:orders.x")
	e.publishNATS("delay.a", []byte("ny"), "delay-after", "1s", "delay-target", "orders.y", "delay-id", "ny")
	waitIngested(t, svc, 2)
	e.ns.Shutdown()
	advanceUntilCond(t, e, "held", func() bool { return svc.Engine().Stats().Held == 2 })
	stop()
	e.mutate = func(c *config.Config) { c.NATS = nil }
	svc, stop = e.start()
	got := e.advanceUntil("kx dead-lettered", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)["kx"]) > 0 })
	if c := byValue(got, kafkaDLQ)["kx"][0].header(codec.HeaderError); c != string(codec.CodeBadTarget) {
		t.Errorf("kx: delay-error %q", c)
	}
	advanceUntilCond(t, e, "readiness names the transport", func() bool {
		err := svc.Ready()
		return err != nil && strings.Contains(err.Error(), "not in the config")
	})
	eventually(t, "the NATS task alone held", func() bool { st := svc.Engine().Stats(); return st.Pending == 1 && st.Held == 1 })
	stop()
	e.mutate = nil
	e.startNATS()
	svc, _ = e.start()
	e.advanceUntil("ny delivered", func(ds []delivery) bool { return len(byValue(ds, "orders.y")["ny"]) > 0 })
	eventually(t, "nothing pending or held", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
}

// Replace, cancel (through the broker) and admin DELETE of held tasks.
func TestHeldE2EReplaceCancel(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, _ := e.start()
	srv := httptest.NewServer(svc.AdminHandler())
	defer srv.Close()
	fail := e.failProduceTo(kafkaOut)
	fail.Store(true)
	for _, id := range []string{"r1", "c1", "d1", "keep"} {
		e.publishKafka(0, time.Time{}, []byte(id), []byte(id+"-old"), "delay-after", "1s", "delay-target", "orders")
	}
	e.publishNATS("delay.a", []byte("nr-old"), "delay-after", "1s", "delay-target", "kafka:orders", "delay-id", "nr")
	e.publishNATS("delay.a", []byte("nc-old"), "delay-after", "1s", "delay-target", "kafka:orders", "delay-id", "nc")
	waitIngested(t, svc, 6)
	advanceUntilCond(t, e, "held", func() bool { return svc.Engine().Stats().Held == 6 })
	code, body := adminCall(t, srv, "GET", "/v1/tasks/delay/r1")
	if code != 200 || !strings.Contains(body, `"held":true`) {
		t.Fatalf("GET held task: %d %s", code, body)
	}
	e.publishKafka(0, time.Time{}, []byte("r1"), []byte("r1-new"), "delay-after", "1h", "delay-target", "orders")
	e.publishKafka(0, time.Time{}, []byte("c1"), []byte(""), "delay-cancel", "true")
	e.publishNATS("delay.a", []byte("nr-new"), "delay-after", "1h", "delay-target", "kafka:orders", "delay-id", "nr")
	e.publishNATS("delay.a", []byte(""), "delay-cancel", "true", "delay-id", "nc")
	if code, body := adminCall(t, srv, "DELETE", "/v1/tasks/delay/d1"); code/100 != 2 {
		t.Fatalf("DELETE: %d %s", code, body)
	}
	eventually(t, "held 2 (keep, ...)", func() bool { st := svc.Engine().Stats(); return st.Held == 1 && st.Pending == 3 })
	if code, body = adminCall(t, srv, "GET", "/v1/stats"); code != 200 || !strings.Contains(body, `"held":1`) {
		t.Fatalf("GET /v1/stats: %d %s; want held 1", code, body)
	}
	fail.Store(false)
	e.advanceUntil("keep", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)["keep-old"]) > 0 })
	e.clk.Advance(time.Hour)
	e.advanceUntil("replacements", func(ds []delivery) bool {
		return len(byValue(ds, kafkaOut)["r1-new"]) > 0 && len(byValue(ds, kafkaOut)["nr-new"]) > 0
	})
	for range 5 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	got := e.deliveries()
	// A replaced or cancelled version may still reach the target once if
	// its probe was being published when the replace or cancel came (the
	// contract's in-flight rule; kafka-go retries a failed produce in real
	// time, and the outage ends meanwhile): under -race in CI that
	// happened. That the replace, cancel and DELETE met the held tasks is
	// the held and pending counts above (and shard's
	// TestHeldTaskReplacedAndCancelled, with no publish in flight).
	for _, v := range []string{"r1-old", "c1-old", "d1-old", "nr-old", "nc-old"} {
		if n := len(byValue(got, kafkaOut)[v]); n > 1 {
			t.Errorf("%s delivered %d times", v, n)
		}
	}
	for _, v := range []string{"r1-new", "nr-new", "keep-old"} {
		if n := len(byValue(got, kafkaOut)[v]); n != 1 {
			t.Errorf("%s delivered %d times", v, n)
		}
	}
	eventually(t, "nothing pending or held", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
}

// A NATS target whose stream is deleted while other subjects are fine:
// its tasks are held (a stream acked it within NoStreamTTL), the others
// delivered; recreated, the held ones are delivered once.
func TestHeldE2EStreamDeleted(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, _, _ := e.runWith(Options{})
	js, err := jetstream.New(e.nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	scfg := jetstream.StreamConfig{Name: "NOSTREAM", Subjects: []string{"nostream.>"}}
	if _, err := js.CreateStream(ctx, scfg); err != nil {
		t.Fatal(err)
	}
	count := func() uint64 {
		s, err := js.Stream(ctx, "NOSTREAM")
		if err != nil {
			return 0
		}
		i, err := s.Info(ctx)
		if err != nil {
			return 0
		}
		return i.State.Msgs
	}
	e.publishNATS("delay.a", []byte("first"), "delay-after", "0", "delay-target", "nostream.a", "delay-id", "first")
	advanceUntilCond(t, e, "first", func() bool { return count() == 1 })
	if err := js.DeleteStream(ctx, "NOSTREAM"); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		s := strconv.Itoa(i)
		e.publishNATS("delay.a", []byte("ns"+s), "delay-after", "1s", "delay-target", "nostream.a", "delay-id", "ns"+s)
		e.publishNATS("delay.a", []byte("ok"+s), "delay-after", "1s", "delay-target", "orders.ok", "delay-id", "ok"+s)
	}
	e.advanceUntil("the others", func(ds []delivery) bool { return len(byValue(ds, "orders.ok")) == 5 })
	advanceUntilCond(t, e, "held", func() bool { return svc.Engine().Stats().Held == 5 })
	if _, err := js.CreateStream(ctx, scfg); err != nil {
		t.Fatal(err)
	}
	advanceUntilCond(t, e, "held delivered", func() bool { return count() == 5 })
	for range 5 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	if c := count(); c != 5 {
		t.Errorf("%d in the recreated stream, want 5", c)
	}
	if dl := len(byValue(e.deliveries(), "dlq.delay")); dl != 0 {
		t.Errorf("%d dead letters", dl)
	}
	eventually(t, "nothing pending or held", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	eventually(t, "ready", func() bool { return svc.Ready() == nil })
}

// One outage after the other, with readiness in between.
func TestHeldE2ESequential(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, _ := e.start()
	fail := e.failProduceTo(kafkaOut)
	pub := func(round, after string) {
		for i := range 5 {
			s := round + strconv.Itoa(i)
			e.publishKafka(int32(i%3), time.Time{}, []byte("k"+s), []byte("k"+s), "delay-after", after, "delay-target", "orders", "x-h", "v")
			e.publishNATS("delay.a", []byte("n"+s), "delay-after", after, "delay-target", "orders.n", "x-h", "v", "delay-id", "n"+s)
			e.publishNATS("delay.a", []byte("x"+s), "delay-after", after, "delay-target", "kafka:orders", "x-h", "v", "delay-id", "x"+s)
			e.publishKafka(int32(i%3), time.Time{}, []byte("y"+s), []byte("y"+s), "delay-after", after, "delay-target", "nats:orders.n", "x-h", "v")
		}
	}
	fail.Store(true)
	pub("a", "1s")
	e.advanceUntil("nats ones", func(ds []delivery) bool { return len(byValue(ds, "orders.n")) == 10 })
	advanceUntilCond(t, e, "kafka held", func() bool { return svc.Engine().Stats().Held == 10 })
	fail.Store(false)
	e.advanceUntil("kafka ones", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) == 10 })
	advanceUntilCond(t, e, "ready", func() bool { return svc.Ready() == nil })
	pub("b", "10m")
	waitIngested(t, svc, 20)
	e.ns.Shutdown()
	e.clk.Advance(10 * time.Minute)
	e.advanceUntil("kafka ones", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) == 20 })
	advanceUntilCond(t, e, "nats held", func() bool { return svc.Engine().Stats().Held == 10 })
	e.startNATS()
	e.advanceUntil("nats ones", func(ds []delivery) bool { return len(byValue(ds, "orders.n")) == 20 })
	for range 5 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	got := e.deliveries()
	for _, d := range []string{kafkaOut, "orders.n"} {
		for v, ds := range byValue(got, d) {
			if len(ds) != 1 {
				t.Errorf("%s %s: %d times", d, v, len(ds))
			}
		}
	}
	eventually(t, "nothing pending or held", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	advanceUntilCond(t, e, "ready", func() bool { return svc.Ready() == nil })
}

// Held tasks revoked by a restart while their DLQ is down too: the dead
// letters are not held, they wait (not ready) and reach the DLQ once.
func TestHeldE2ERevokedWithDLQDown(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, stop := e.start()
	failOut := e.failProduceTo(kafkaOut)
	failDLQ := e.failProduceTo(kafkaDLQ)
	failOut.Store(true)
	for i := range 5 {
		s := strconv.Itoa(i)
		e.publishKafka(0, time.Time{}, []byte("rv"+s), []byte("rv"+s), "delay-after", "1s", "delay-target", "orders")
	}
	waitIngested(t, svc, 5)
	advanceUntilCond(t, e, "held", func() bool { return svc.Engine().Stats().Held == 5 })
	failDLQ.Store(true)
	stop()
	e.mutate = func(c *config.Config) { c.Targets.Allow = []string{"nats:orders.>"} }
	svc, _ = e.start()
	advanceUntilCond(t, e, "released into dead letters", func() bool { st := svc.Engine().Stats(); return st.Held == 0 && st.Pending == 5 })
	for range 5 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	if st := svc.Engine().Stats(); st.Held != 0 || st.Pending != 5 {
		t.Fatalf("pending %d held %d", st.Pending, st.Held)
	}
	if svc.Ready() == nil {
		t.Fatal("ready while dead letters fail")
	}
	failDLQ.Store(false)
	e.advanceUntil("dead letters", func(ds []delivery) bool { return len(byValue(ds, kafkaDLQ)) == 5 })
	for range 5 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	got := e.deliveries()
	for v, ds := range byValue(got, kafkaDLQ) {
		if len(ds) != 1 || ds[0].header(codec.HeaderError) != string(codec.CodeTargetNotAllowed) {
			t.Errorf("%s: %d dead letters, code %s", v, len(ds), ds[0].header(codec.HeaderError))
		}
	}
	if n := len(byValue(got, kafkaOut)); n != 0 {
		t.Errorf("%d delivered to the revoked target", n)
	}
	eventually(t, "nothing pending", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	advanceUntilCond(t, e, "ready", func() bool { return svc.Ready() == nil })
}

// Dead letters on a down DLQ with waiting_in_memory 0: never held; the
// source's commit waits; a held task that then fails as its own fault is
// dead-lettered publish-failed once its attempts are used up.
func TestHeldE2EDLQDown(t *testing.T) {
	e := newEnv(t, heldRetryCfg)
	svc, stop := e.start()
	failOut := e.failProduceTo(kafkaOut)
	failDLQ := e.failProduceTo(kafkaDLQ)
	failOut.Store(true)
	e.publishKafka(0, time.Time{}, []byte("h1"), []byte("h1"), "delay-after", "1s", "delay-target", "orders")
	waitIngested(t, svc, 1)
	advanceUntilCond(t, e, "held", func() bool { return svc.Engine().Stats().Held == 1 })
	eventually(t, "commit", func() bool { return e.committedOffset(0) == 1 })
	failDLQ.Store(true)
	e.publishKafka(0, time.Time{}, []byte("b1"), []byte("bad"), "delay-target", "orders") // missing-due
	waitIngested(t, svc, 2)
	for range 5 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	if st := svc.Engine().Stats(); st.Held != 1 || st.Pending != 2 {
		t.Fatalf("pending %d held %d: a dead letter must not be held", st.Pending, st.Held)
	}
	if off := e.committedOffset(0); off != 1 {
		t.Fatalf("committed %d past a dead letter its DLQ has not taken", off)
	}
	// The held task's target now refuses it as its own fault.
	failOut.Store(false)
	fault := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaOut, Err: kerr.TopicAuthorizationFailed, Count: -1})
	advanceUntilCond(t, e, "the held task out of the held range", func() bool { return svc.Engine().Stats().Held == 0 && fault.Hits() >= 2 })
	stop()
	svc, _ = e.start()
	srv := httptest.NewServer(svc.AdminHandler())
	defer srv.Close()
	_, m := adminCall(t, srv, "GET", "/metrics")
	for _, line := range strings.Split(m, "\n") {
		if strings.HasPrefix(line, "delaybridge_held_tasks{") && !strings.HasSuffix(line, " 0") {
			t.Errorf("after restart: %s", line)
		}
	}
	failDLQ.Store(false)
	got := e.advanceUntil("both dead letters", func(ds []delivery) bool {
		return len(byValue(ds, kafkaDLQ)["bad"]) > 0 && len(byValue(ds, kafkaDLQ)["h1"]) > 0
	})
	if c := byValue(got, kafkaDLQ)["h1"][0].header(codec.HeaderError); c != string(codec.CodePublishFailed) {
		t.Errorf("h1: %s", c)
	}
	eventually(t, "the commit past the bad message", func() bool { return e.committedOffset(0) == 2 })
	eventually(t, "nothing pending", func() bool { st := svc.Engine().Stats(); return st.Pending == 0 && st.Held == 0 })
	for range 3 {
		e.clk.Advance(time.Second)
		time.Sleep(30 * time.Millisecond)
	}
	got = e.deliveries()
	if n, m := len(byValue(got, kafkaDLQ)["h1"]), len(byValue(got, kafkaDLQ)["bad"]); n != 1 || m != 1 {
		t.Errorf("dead letters: h1 %d, bad %d", n, m)
	}
}

// TestHeldE2EPartialPartition: one partition of a target topic refusing
// writes (NOT_ENOUGH_REPLICAS) while the others take them. The waiting
// tasks of that partition, held on disk or in memory, are tried once per
// backoff while new tasks to the same topic keep being delivered.
func TestHeldE2EPartialPartition(t *testing.T) {
	for _, tc := range []struct{ name, cfg string }{
		{"memory", "retry: {initial: 1s, max: 30s, multiplier: 2, jitter: 0, max_attempts: 2}\nshards: 1\n"},
		{"held", "retry: {initial: 1s, max: 30s, multiplier: 2, jitter: 0, max_attempts: 2, waiting_in_memory: 0}\nshards: 1\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.cfg)
			svc, _ := e.start()
			var p0, other []string
			for i := 0; len(p0) < 5 || len(other) < 40; i++ {
				k := "key" + strconv.Itoa(i)
				if (&kafkago.Murmur2Balancer{}).Balance(kafkago.Message{Key: []byte(k)}, 0, 1, 2) == 0 {
					if len(p0) < 5 {
						p0 = append(p0, k)
					}
				} else if len(other) < 40 {
					other = append(other, k)
				}
			}
			fault := e.kc.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: kafkaOut, Partitions: []int32{0}, Err: kerr.NotEnoughReplicas, Count: -1})
			for _, k := range p0 {
				e.publishKafka(0, time.Time{}, []byte(k), []byte(k), "delay-after", "1s", "delay-target", "orders")
			}
			waitIngested(t, svc, 5)
			advanceUntilCond(t, e, "failing", func() bool { return fault.Hits() >= 1 })
			h0 := fault.Hits()
			// 40 s of fake time, a new task to another partition each second.
			for i := range 40 {
				e.publishKafka(0, time.Time{}, []byte(other[i]), []byte(other[i]), "delay-after", "0", "delay-target", "orders")
				e.advanceUntil("delivery", func(ds []delivery) bool { return len(byValue(ds, kafkaOut)) >= i+1 })
			}
			st := svc.Engine().Stats()
			t.Logf("%s: %d produce requests refused for partition 0 over the 40 deliveries (held %d, pending %d)", tc.name, fault.Hits()-h0, st.Held, st.Pending)
			// Tried once per backoff (1, 2, 4, 8, 16 s; kafka-go retries
			// each request): 10 in memory, about 20 held. Before held
			// groups kept their backoff through deliveries to the rest of
			// the topic, 118.
			if n := fault.Hits() - h0; n > 40 {
				t.Errorf("%s: partition 0 tried %d times in 40 s of a 1s..30s backoff: every delivery to its other partitions re-probed it", tc.name, n)
			}
		})
	}
}
