package fault

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/delaybridge/delaybridge/codec"
)

// TestKill9ThroughTargetOutage SIGKILLs the bridge repeatedly during and
// after an outage of its target broker: a thousand tasks (3000 in the
// long form) from the Kafka source for a NATS subject come due while the
// NATS server is down (the NATS sink fails them as unavailable), most of
// them held on disk (retry.waiting_in_memory 100 a shard). Each round
// kills the bridge during the outage (while tasks are held and probed),
// at the server's return or during the release, and once everything is
// delivered, restarting it each time. The waiting records (u keys,
// shard/recover.go) must bring the release back after each restart: the
// last task reaches the target within seconds of the return, not at its
// own retry (about as long after the return as the outage lasted, up to
// retry.max). After each restart every task is pending or delivered, and
// Stats' oldest overdue is no older than the round's earliest due; once
// all is delivered, the store (opened read-only after the kill) holds no
// waiting record and no task.
func TestKill9ThroughTargetOutage(t *testing.T) {
	t.Parallel()
	rounds, tasks := 2, 1000
	// 14-15 s: a task left to its own retry (the waits double from
	// 100 ms: 12.8 s overdue, then 25.6 s) goes about 11 s after the
	// return.
	outageMin, outageSpread := 14*time.Second, time.Second
	if long() {
		rounds, tasks = 22, 3000
		outageMin, outageSpread = 10*time.Second, 10*time.Second
	}
	// A task left to its own retry after the return goes up to about as
	// long as it was overdue (the outage) later; the release takes them
	// all within a second or two, a restart's start and catch-up
	// included.
	const maxReturnToLast = 5 * time.Second
	const target, inMemory = "orders.h181", 400
	b := newBrokers(t, 0)
	col := b.collect(t)
	storeDir := filepath.Join(t.TempDir(), "store")
	r := newRunner(t, b, bridgeConfig{
		dataDir: storeDir,
		retry:   fmt.Sprintf("{initial: 100ms, max: 60s, multiplier: 2, jitter: 0.1, max_attempts: 100000, waiting_in_memory: %d}", inMemory),
	})
	kcl := b.kafkaClient()
	defer kcl.Close()
	ac := &adminClient{t: t, base: "http://" + r.admin, c: &http.Client{Timeout: 5 * time.Second}}
	seed := uint64(time.Now().UnixNano())
	t.Logf("random seed %d (kill times are real time: a seed repeats the choices, not the run)", seed)
	rng := rand.New(rand.NewPCG(seed, 181))

	p := r.start()
	p.waitLog(90*time.Second, "delaybridge running")
	killed := map[string]int{}
	var sentAll []string
	var worst, worstLag time.Duration
	var maxWaiting int
	// restart starts the bridge again after a kill and checks what it
	// recovered: every value of vals is pending or delivered, and the
	// oldest overdue is not before minDue.
	restart := func(round int, vals []string, minDue time.Time) *proc {
		t.Helper()
		p := r.start()
		p.waitLog(90*time.Second, "store recovered")
		ac.waitUp(p)
		var missing []string
		got := col.byValue(isTarget)
		for _, v := range vals {
			if len(got[v]) == 0 && !ac.pending(v) {
				missing = append(missing, v)
			}
		}
		// One not pending may have been delivered since the collector
		// looked: it must show up there.
		if len(missing) > 0 && !waitFor(30*time.Second, func() bool {
			lost, _ := lostAndDups(col, missing)
			return len(lost) == 0
		}) {
			lost, _ := lostAndDups(col, missing)
			t.Fatalf("round %d: after a restart %d tasks neither pending nor delivered (e.g. %v)", round, len(lost), lost[:min(5, len(lost))])
		}
		if st := ac.stats(); st.Pending > 0 && !st.OldestOverdue.IsZero() && st.OldestOverdue.Before(minDue.Add(-time.Millisecond)) {
			t.Errorf("round %d: after a restart oldest_overdue %v is before the round's earliest due %v", round, st.OldestOverdue, minDue)
		}
		return p
	}
	// kill kills p and counts the waiting records it left: at most
	// waiting_in_memory.
	kill := func(round int, p *proc, phase string) {
		p.kill()
		u, tk := countStoreKeys(t, storeDir)
		if phase == "release" && tk == 0 {
			phase = "after the release" // it ended between the look and the kill
		}
		killed[phase]++
		t.Logf("round %d: killed (%s): store holds %d waiting records, %d tasks", round, phase, u, tk)
		if u > inMemory {
			t.Errorf("round %d: %d waiting records, over waiting_in_memory %d", round, u, inMemory)
		}
		maxWaiting = max(maxWaiting, u)
	}

	for round := 1; round <= rounds; round++ {
		b.stopNATS()
		outageBegan := time.Now()
		outage := outageMin + time.Duration(rng.Int64N(int64(outageSpread)))

		// The round's tasks, due within 2 s, for the NATS target.
		prefix := "h" + strconv.Itoa(round) + "-"
		var recs []*kgo.Record
		var vals []string
		for i := range tasks {
			v := prefix + strconv.Itoa(i)
			recs = append(recs, kafkaRecord(int32(i%3), []byte(v), []byte(v), hdr(
				codec.HeaderAfter, strconv.Itoa(rng.IntN(2001)), codec.HeaderTarget, "nats:"+target)))
			vals = append(vals, v)
		}
		res := kcl.ProduceSync(context.Background(), recs...)
		if err := res.FirstErr(); err != nil {
			t.Fatalf("produce: %v", err)
		}
		minDue := time.Now()
		for _, pr := range res {
			if pr.Record.Timestamp.Before(minDue) {
				minDue = pr.Record.Timestamp
			}
		}
		sentAll = append(sentAll, vals...)
		// Taken in: each is pending from here on, or delivered.
		if !waitFor(60*time.Second, func() bool { return ac.stats().Pending >= int64(tasks) }) {
			t.Fatalf("round %d: %d tasks not taken in: pending %d", round, tasks, ac.stats().Pending)
		}

		// Kills during the outage: one or two, at random moments. A
		// restarted bridge fires nothing until the NATS source has
		// caught up (at the return): a first kill before the tasks
		// failed leaves nothing waiting. The short form kills once, in
		// the outage's last third, when most are held.
		kills := 1 + rng.IntN(2)
		if !long() {
			kills = 1
			time.Sleep(outage * 2 / 3)
		}
		for k := kills; k > 0; k-- {
			left := outage - time.Since(outageBegan)
			if left < 500*time.Millisecond {
				break
			}
			time.Sleep(time.Duration(rng.Int64N(int64(left - 300*time.Millisecond))))
			phase := "outage"
			if st := ac.stats(); st.Held > 0 {
				phase = "outage, tasks held"
			}
			kill(round, p, phase)
			p = restart(round, vals, minDue)
		}
		if d := outage - time.Since(outageBegan); d > 0 {
			time.Sleep(d)
		}
		st := ac.stats()
		b.startNATS()
		back := time.Now()
		t.Logf("round %d: outage %v, at the return %d pending, %d held",
			round, back.Sub(outageBegan).Round(time.Millisecond), st.Pending, st.Held)

		choice := rng.IntN(3)
		if !long() {
			choice = round % 2 // a kill at the return, then during the release
		}
		switch choice {
		case 1:
			time.Sleep(time.Duration(rng.Int64N(int64(300 * time.Millisecond))))
			kill(round, p, "return")
			p = restart(round, vals, minDue)
		case 0:
			// While the release goes: once the target holds some of the
			// round's tasks and not all (the bridge's pending count falls).
			left := int64(float64(tasks) * (0.2 + 0.75*rng.Float64()))
			deadline := time.Now().Add(30 * time.Second)
			for ac.stats().Pending > left && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			phase := "release"
			if ac.stats().Pending == 0 {
				phase = "after the release"
			}
			kill(round, p, phase)
			p = restart(round, vals, minDue)
		}

		if !waitFor(2*time.Minute, func() bool { lost, _ := lostAndDups(col, vals); return len(lost) == 0 }) {
			lost, _ := lostAndDups(col, vals)
			t.Fatalf("round %d: %d of %d tasks not delivered 2 min after the return (e.g. %v)", round, len(lost), tasks, lost[:min(5, len(lost))])
		}
		// A bridge started during the outage connects to NATS at its
		// next connect attempt after the return (its backoff is 2 s at
		// most while firing waits for the NATS source to catch up, and
		// up to 30 s after, when deliveries ask for attempts): the
		// delivery is timed from the first connection after the return,
		// and the connection's own lag is bounded loosely (wall clock,
		// machine load).
		last := lastStored(t, b, "ORDERS")
		connected := r.loggedAfter(back, `"nats: connected"`, `"nats: reconnected"`)
		took, lag := last.Sub(back), time.Duration(0)
		if connected.After(back) {
			lag = connected.Sub(back)
		}
		worst, worstLag = max(worst, took-lag), max(worstLag, lag)
		_, dups := lostAndDups(col, vals)
		t.Logf("round %d: last delivery %v after the return, the bridge connected %v after it; %d duplicates",
			round, took.Round(time.Millisecond), lag.Round(time.Millisecond), dups)
		if took-lag > maxReturnToLast {
			t.Errorf("round %d: last delivery %v after the target's return (connected %v after it), want within %v of the connection",
				round, took.Round(time.Millisecond), lag.Round(time.Millisecond), maxReturnToLast)
		}
		if lag > 30*time.Second+maxReturnToLast {
			t.Errorf("round %d: the bridge connected to the returned target %v after its return, over the connect backoff's 30 s at most", round, lag.Round(time.Millisecond))
		}
		if !waitFor(30*time.Second, func() bool { s := ac.stats(); return s.Pending == 0 && s.Held == 0 && s.OldestOverdue.IsZero() }) {
			t.Errorf("round %d: everything delivered, but stats %+v", round, ac.stats())
		}

		// Nothing waits: the store keeps no waiting record.
		kill(round, p, "drained")
		if u, tk := countStoreKeys(t, storeDir); u != 0 || tk != 0 {
			t.Errorf("round %d: drained store holds %d waiting records, %d tasks", round, u, tk)
		}
		p = restart(round, nil, minDue)
		p.waitLog(90*time.Second, "delaybridge running")
	}

	lost, dups := lostAndDups(col, sentAll)
	t.Logf("%d rounds, %d tasks: kills %v; worst connection to last delivery %v, worst return to connection %v; at most %d waiting records at a kill; %d lost, %d duplicates",
		rounds, len(sentAll), killed, worst.Round(time.Millisecond), worstLag.Round(time.Millisecond), maxWaiting, len(lost), dups)
	if len(lost) > 0 {
		t.Errorf("%d tasks lost", len(lost))
	}
	if dl := col.byValue(isDLQ); len(dl) > 0 {
		t.Errorf("%d tasks dead-lettered", len(dl))
	}
	if err := p.term(); err != nil {
		t.Errorf("bridge stop: %v", err)
	}
}

// adminClient asks a bridge's admin API.
type adminClient struct {
	t    *testing.T
	base string
	c    *http.Client
}

type adminStats struct {
	Pending       int64     `json:"pending"`
	Held          int64     `json:"held"`
	OldestOverdue time.Time `json:"oldest_overdue"`
}

func (a *adminClient) get(path string) (int, []byte) {
	resp, err := a.c.Get(a.base + path)
	if err != nil {
		return 0, nil
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(resp.Body)
	return resp.StatusCode, buf.Bytes()
}

// waitUp waits until p's admin API answers.
func (a *adminClient) waitUp(p *proc) {
	a.t.Helper()
	if !waitFor(60*time.Second, func() bool { code, _ := a.get("/v1/stats"); return code == http.StatusOK || !p.running() }) || !p.running() {
		a.t.Fatalf("admin API of the restarted bridge does not answer (running %v)", p.running())
	}
}

func (a *adminClient) stats() adminStats {
	a.t.Helper()
	code, body := a.get("/v1/stats")
	if code != http.StatusOK {
		a.t.Fatalf("GET /v1/stats: %d %s", code, body)
	}
	var st adminStats
	if err := json.Unmarshal(body, &st); err != nil {
		a.t.Fatalf("GET /v1/stats: %v: %s", err, body)
	}
	return st
}

// pending reports whether the task of the Kafka source with id is pending.
func (a *adminClient) pending(id string) bool {
	a.t.Helper()
	code, body := a.get("/v1/tasks/" + kafkaDelay + "/" + url.PathEscape(id))
	switch code {
	case http.StatusOK:
		return true
	case http.StatusNotFound:
		return false
	}
	a.t.Fatalf("GET task %s: %d %s", id, code, body)
	return false
}

// lastStored is when the stream's last message was stored.
func lastStored(t *testing.T, b *brokers, stream string) time.Time {
	t.Helper()
	nc := b.natsConn()
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastTime
}

// countStoreKeys opens the store of a stopped bridge read-only and counts
// its waiting records (u keys) and tasks (t keys).
func countStoreKeys(t *testing.T, dir string) (waiting, tasks int) {
	t.Helper()
	db, err := pebble.Open(dir, &pebble.Options{
		ReadOnly: true,
		Logger:   quietPebble{},
		// The store's merger name must match; nothing is merged here.
		Merger: &pebble.Merger{Name: "delaybridge.counters.v1", Merge: pebble.DefaultMerger.Merge},
	})
	if err != nil {
		t.Fatalf("open store read-only: %v", err)
	}
	defer db.Close()
	for _, prefix := range []byte{'u', 't'} {
		it, err := db.NewIter(&pebble.IterOptions{LowerBound: []byte{prefix}, UpperBound: []byte{prefix + 1}})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for ok := it.First(); ok; ok = it.Next() {
			n++
		}
		if err := it.Close(); err != nil {
			t.Fatal(err)
		}
		if prefix == 'u' {
			waiting = n
		} else {
			tasks = n
		}
	}
	return waiting, tasks
}

// quietPebble is a pebble.Logger that says nothing (the read-only open
// logs its WAL replay).
type quietPebble struct{}

func (quietPebble) Infof(string, ...any)  {}
func (quietPebble) Errorf(string, ...any) {}
func (quietPebble) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf(format, args...))
}

// loggedAfter returns the time of the first line of the bridges' log at
// or after from containing one of subs (zero if none).
func (r *runner) loggedAfter(from time.Time, subs ...string) time.Time {
	r.t.Helper()
	b, err := os.ReadFile(r.logPath)
	if err != nil {
		r.t.Fatal(err)
	}
	for line := range bytes.Lines(b) {
		if !slices.ContainsFunc(subs, func(sub string) bool { return bytes.Contains(line, []byte(sub)) }) {
			continue
		}
		var l struct {
			TS time.Time `json:"ts"`
		}
		if json.Unmarshal(line, &l) == nil && !l.TS.Before(from) {
			return l.TS
		}
	}
	return time.Time{}
}
