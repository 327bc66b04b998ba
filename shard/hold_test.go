package shard

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// inMemory is what a shard keeps in memory for its tasks: wheel entries
// and the due times of those waiting for a retry.
func (e *Engine) inMemory() (wheel, late int) {
	for _, s := range e.shards {
		s.mu.Lock()
		wheel += s.w.Len()
		late += len(s.late)
		s.mu.Unlock()
	}
	return wheel, late
}

// holdHarness: one shard keeping at most memory waiting tasks in memory
// (negative: none, every one held), batches of 8, retries after 1 s
// doubling to 8 s, no jitter; mod adjusts the options further.
func holdHarness(t *testing.T, memory int, mod ...func(*Options)) *harness {
	return newHarness(t, func(o *Options) {
		o.Shards = 1
		o.OutageMemory = memory
		o.FireBatch = 8
		o.Retry = RetryPolicy{Initial: time.Second, Max: 8 * time.Second, Multiplier: 2, Jitter: -1, MaxAttempts: 3}
		for _, m := range mod {
			m(o)
		}
	})
}

// holdTasks ingests batch against a sink that refuses every delivery as
// unavailable, runs the engine and lets the tasks come due (a second
// round for retries of the first): want of them must then be held.
func holdTasks(t *testing.T, h *harness, batch []codec.Task, want int64) {
	t.Helper()
	h.sink.setFail(func(*codec.Task) error { return errDown })
	h.ingest(batch)
	h.run()
	h.advance(time.Second)
	if h.e.Stats().Held != want {
		h.advance(time.Second)
	}
	if st := h.e.Stats(); st.Held != want {
		t.Fatalf("held %d, want %d", st.Held, want)
	}
}

// checkDeliveredOnce fails unless the sink acknowledged n deliveries, each
// of another id.
func checkDeliveredOnce(t *testing.T, h *harness, n int) {
	t.Helper()
	acked := h.sink.acked()
	slices.Sort(acked)
	if ids := len(slices.Compact(slices.Clone(acked))); len(acked) != n || ids != n {
		t.Fatalf("%d deliveries (%d ids), want each of %d once", len(acked), ids, n)
	}
}

// TestOutageHoldsTasksOnDisk: through a long outage of its target, a
// shard keeps at most OutageMemory tasks waiting in memory; the others
// are held on disk, probed one batch per backoff, and every one is
// delivered once the target answers again, exactly once and with no
// attempt charged. Before holding, every overdue task stayed in the wheel
// and the late map for the whole outage (200 of each here).
func TestOutageHoldsTasksOnDisk(t *testing.T) {
	h := holdHarness(t, 10)
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	const n = 200
	var batch []codec.Task
	for i := range n {
		batch = append(batch, sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1)))
	}
	h.ingest(batch)
	h.run()
	for range 60 { // a minute of outage, retries and probes included
		h.advance(time.Second)
		if w, late := h.e.inMemory(); w > 10 || late > 10 {
			t.Fatalf("at %v: %d wheel entries and %d late tasks in memory; want at most OutageMemory (10)", h.clk.Now().Sub(t0), w, late)
		}
	}
	st := h.e.Stats()
	if st.Pending != n || st.Held != n-10 {
		t.Fatalf("Stats: pending %d, held %d; want %d and %d", st.Pending, st.Held, n, n-10)
	}
	if want := ms(t0.Add(time.Second)); st.OldestOverdue.UnixMilli() != want {
		t.Fatalf("oldest overdue %v, want the due time of the held tasks", st.OldestOverdue)
	}
	if got := h.sink.acked(); len(got) != 0 {
		t.Fatalf("%d delivered while the target is down", len(got))
	}
	// Probes: each held task is tried at most once per backoff, not each
	// round: the first try of all 200, then one batch per probe.
	tries := len(h.sink.all())
	if tries > n+10*8+20*8 {
		t.Fatalf("%d delivery attempts in a minute of outage; held tasks are tried too often", tries)
	}
	info, err := h.e.Lookup("src", "t150")
	if err != nil || !info.Held || !info.NextFire.IsZero() || info.Attempts != 0 {
		t.Fatalf("Lookup of a held task = %+v, %v; want held, no next fire, no attempt", info, err)
	}

	// Back: the next probe finds it, and everything is delivered.
	h.sink.setFail(nil)
	for range 20 {
		h.advance(time.Second)
	}
	checkDeliveredOnce(t, h, n)
	for _, d := range h.sink.all() {
		if d.Err == nil && d.Attempts != 0 {
			t.Fatalf("%s delivered with %d attempts charged; an outage charges none", d.ID, d.Attempts)
		}
	}
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 || !st.OldestOverdue.IsZero() {
		t.Fatalf("after delivery: %+v", st)
	}
	h.checkPending()
}

// holdAll ingests n tasks due at t0+1s on the harness's target "out" and
// lets them come due against a sink that refuses every delivery as
// unavailable until most are held.
func holdAll(t *testing.T, h *harness, n int) {
	t.Helper()
	var batch []codec.Task
	for i := range n {
		batch = append(batch, sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1)))
	}
	holdTasks(t, h, batch, int64(n-10))
}

// TestHeldTasksSurviveRestart: the held tasks, their count and their
// oldest due are found again after a restart, stay out of the wheel,
// and are delivered once the target answers.
func TestHeldTasksSurviveRestart(t *testing.T) {
	h := holdHarness(t, 10)
	const n = 100
	holdAll(t, h, n)
	h.advance(3 * time.Second)
	h.reopen()
	if w, _ := h.e.inMemory(); w > 10 {
		t.Fatalf("%d wheel entries after the reopen; held tasks must stay on disk", w)
	}
	st := h.e.Stats()
	if st.Pending != n || st.Held != n-10 || st.OldestOverdue.UnixMilli() != ms(t0.Add(time.Second)) {
		t.Fatalf("after the reopen: pending %d, held %d, oldest overdue %v; want %d, %d, %v", st.Pending, st.Held, st.OldestOverdue, n, n-10, t0.Add(time.Second))
	}
	h.sink.reset()
	h.sink.setFail(nil)
	h.run()
	for range 10 {
		h.advance(time.Second)
	}
	checkDeliveredOnce(t, h, n)
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
		t.Fatalf("after delivery: %+v", st)
	}
	h.checkPending()
}

// TestHeldTaskReplacedAndCancelled: a replace or cancel meets a held task
// as any stored one: the cancelled one is never delivered, the replaced
// one only as its new version at its new due, and the held count follows.
func TestHeldTaskReplacedAndCancelled(t *testing.T) {
	h := holdHarness(t, 10)
	const n = 50
	holdAll(t, h, n)
	for _, id := range []string{"t040", "t041"} {
		if info, err := h.e.Lookup("src", id); err != nil || !info.Held {
			t.Fatalf("Lookup(%s) = %+v, %v; want a held task", id, info, err)
		}
	}
	newer := sched("t041", t0.Add(30*time.Second), 1000)
	newer.Value = []byte("newer")
	h.ingest([]codec.Task{cancelTask("t040", 999), newer})
	if err := h.e.Cancel("src", "t042"); err != nil {
		t.Fatalf("Cancel(t042): %v", err)
	}
	if st := h.e.Stats(); st.Held != n-13 || st.Pending != n-2 {
		t.Fatalf("after a cancel, a replace and an admin cancel of held tasks: held %d, pending %d; want %d, %d", st.Held, st.Pending, n-13, n-2)
	}
	h.sink.setFail(nil)
	for range 10 {
		h.advance(time.Second)
	}
	var got []string
	for _, d := range h.sink.all() {
		if d.Err != nil {
			continue
		}
		switch d.ID {
		case "t040", "t042":
			t.Fatalf("cancelled held task %s delivered", d.ID)
		case "t041":
			t.Fatalf("replaced held task t041 delivered as %q before its new due", d.Value)
		}
		got = append(got, d.ID)
	}
	if len(got) != n-3 {
		t.Fatalf("%d delivered, want %d", len(got), n-3)
	}
	h.set(t0.Add(30 * time.Second))
	acked := h.sink.acked()
	if last := acked[len(acked)-1]; last != "t041" || len(acked) != n-2 {
		t.Fatalf("after the new due: %d delivered, last %s; want t041's newer version", len(acked), last)
	}
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
		t.Fatalf("after delivery: %+v", st)
	}
	h.checkPending()
}

// TestHeldTasksOfADownTargetDoNotHoldBackOthers: after an outage of the
// transport, one of its targets stays down. Its held tasks stay held and
// are probed at a backoff; the held tasks of the other target behind
// them in the held range are all delivered.
func TestHeldTasksOfADownTargetDoNotHoldBackOthers(t *testing.T) {
	h := holdHarness(t, 10)
	const n = 120
	down := fmt.Errorf("broker down: %w", ErrUnavailable)
	h.sink.setFail(func(*codec.Task) error { return down })
	var batch []codec.Task
	for i := range n {
		task := sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1))
		if i < 60 {
			task.Target = "down" // the first 60 held are the down target's
		}
		batch = append(batch, task)
	}
	h.ingest(batch)
	h.run()
	h.advance(time.Second)
	h.sink.setFail(func(t *codec.Task) error {
		if t.Target == "down" {
			return down
		}
		return nil
	})
	for range 30 {
		h.advance(time.Second)
	}
	delivered := map[string]bool{}
	for _, id := range h.sink.acked() {
		delivered[id] = true
	}
	for i := 60; i < n; i++ {
		if id := fmt.Sprintf("t%03d", i); !delivered[id] {
			t.Fatalf("%s (target out, up) not delivered; the down target's held tasks hold it back", id)
		}
	}
	if len(delivered) != n-60 {
		t.Fatalf("%d delivered, want %d", len(delivered), n-60)
	}
	if st := h.e.Stats(); st.Pending != 60 || st.Held+int64(len(h.e.shards[0].late)) != 60 {
		t.Fatalf("the down target's 60 tasks: %+v", st)
	}
}

// TestHeldTaskOtherFailureLeavesHold: a released held task whose publish
// fails for another reason than an outage leaves the held range for the
// wheel, with its attempt counted, and ends as a publish-failed dead
// letter when its attempts are used up.
func TestHeldTaskOtherFailureLeavesHold(t *testing.T) {
	h := holdHarness(t, 10)
	const n = 30
	holdAll(t, h, n)
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID == "t025" && t.Kind == codec.KindSchedule {
			return errors.New("record too large")
		}
		return nil
	})
	for range 30 {
		h.advance(time.Second)
	}
	var dl *delivery
	for _, d := range h.sink.all() {
		if d.Kind == codec.KindDeadLetter && d.Err == nil {
			dl = &d
		}
	}
	if dl == nil || dl.Code != codec.CodePublishFailed || !strings.Contains(dl.Detail, "after 3 attempts") {
		t.Fatalf("dead letter of t025: %+v; want publish-failed after 3 attempts", dl)
	}
	if st := h.e.Stats(); st.Pending != 0 || st.Held != 0 {
		t.Fatalf("after delivery: %+v", st)
	}
	h.checkPending()
}

var errDown = fmt.Errorf("broker down: %w", ErrUnavailable)

// TestHeldReleaseFairAcrossTransports: after an outage of both
// brokers, 400 Kafka and 40 NATS tasks are held. Both come back: each
// lane releases its own held tasks; the NATS ones must not wait for the
// whole Kafka backlog. The order checked is the fire loop's, in which it
// hands the batches to their lanes (testHookDispatch): the lanes publish
// side by side, so the order of the sink's acknowledgements depends on
// scheduling too (under CPU load the NATS lane's first batch, handed over
// with the first Kafka one, reached the sink after five more Kafka ones).
func TestHeldReleaseFairAcrossTransports(t *testing.T) {
	h := holdHarness(t, -1)
	var batch []codec.Task
	for i := range 400 {
		batch = append(batch, sched(fmt.Sprintf("k%03d", i), t0.Add(time.Second), int64(i+1)))
	}
	for i := range 40 {
		n := sched(fmt.Sprintf("n%03d", i), t0.Add(time.Second), int64(1000+i))
		n.Transport, n.Target = codec.TransportNATS, "subj"
		batch = append(batch, n)
	}
	holdTasks(t, h, batch, 440)
	h.sink.reset()
	h.sink.setFail(nil)
	var dispatched []string // under the shard lock
	h.e.testHookDispatch = func(part []fireItem) {
		for _, it := range part {
			dispatched = append(dispatched, it.task.ID)
		}
	}
	h.advance(10 * time.Second) // both groups' backoffs over: one release round
	h.e.testHookDispatch = nil  // (the loop is settled: parked, no lane busy)
	checkDeliveredOnce(t, h, 440)
	lastNATS, firstNATS := -1, -1
	var pos []int
	for i, id := range dispatched {
		if id[0] == 'n' {
			pos = append(pos, i)
			lastNATS = i
			if firstNATS < 0 {
				firstNATS = i
			}
		}
	}
	t.Logf("%d handed to their lanes; NATS at %v", len(dispatched), pos)
	// Starved, the NATS tasks came after all 400 Kafka ones.
	if lastNATS > 40+200 {
		t.Errorf("the last NATS held task was handed to its lane after %d Kafka ones", lastNATS-39)
	}
	if firstNATS > 4*8 {
		t.Errorf("the first NATS held task was handed to its lane after %d Kafka ones: the NATS lane waits for the Kafka lane's whole held backlog", firstNATS)
	}
}

// holdTwoTargets holds 20 tasks of target "a" due at t0+1s and 20 of "b"
// due at t0+20s (every waiting task held), at t0+30s.
func holdTwoTargets(t *testing.T) *harness {
	h := holdHarness(t, -1)
	h.sink.setFail(func(*codec.Task) error { return errDown })
	var batch []codec.Task
	for i := range 20 {
		a := sched(fmt.Sprintf("a%02d", i), t0.Add(time.Second), int64(i+1))
		a.Target = "a"
		b := sched(fmt.Sprintf("b%02d", i), t0.Add(20*time.Second), int64(100+i))
		b.Target = "b"
		batch = append(batch, a, b)
	}
	h.ingest(batch)
	h.run()
	for range 30 {
		h.advance(time.Second)
	}
	if st := h.e.Stats(); st.Held != 40 || st.OldestOverdue.UnixMilli() != ms(t0.Add(time.Second)) {
		t.Fatalf("before: held %d, oldest overdue %v", st.Held, st.OldestOverdue)
	}
	return h
}

// TestHeldOldestOverdueAfterRestart: after a restart the oldest
// overdue of held tasks is the first held key's due, which is not the
// oldest when another target's group sorts first.
func TestHeldOldestOverdueAfterRestart(t *testing.T) {
	h := holdTwoTargets(t)
	h.reopen()
	if st := h.e.Stats(); st.OldestOverdue.UnixMilli() != ms(t0.Add(time.Second)) {
		t.Errorf("after a restart: oldest overdue %v, want %v (a's held tasks, still pending)", st.OldestOverdue.Time, t0.Add(time.Second))
	}
}

// TestHeldOldestOverdueAfterPartialRelease: a's held tasks are
// delivered, b's stay held: the oldest overdue must be b's due.
func TestHeldOldestOverdueAfterPartialRelease(t *testing.T) {
	h := holdTwoTargets(t)
	h.sink.setFail(func(tk *codec.Task) error {
		if tk.Target == "b" {
			return errDown
		}
		return nil
	})
	for range 20 {
		h.advance(time.Second)
	}
	st := h.e.Stats()
	if st.Held != 20 {
		t.Fatalf("held %d, want b's 20", st.Held)
	}
	if st.OldestOverdue.UnixMilli() != ms(t0.Add(20*time.Second)) {
		t.Errorf("a delivered, b held: oldest overdue %v, want %v (b's due)", st.OldestOverdue.Time, t0.Add(20*time.Second))
	}
}

// TestHeldOldestOverdueOutOfOrder: of two held tasks of one target, the
// one ingested first is due later; the oldest overdue is the other's due,
// before and after a restart (held tasks lie in due order per target).
func TestHeldOldestOverdueOutOfOrder(t *testing.T) {
	h := holdHarness(t, -1)
	h.sink.setFail(func(*codec.Task) error { return errDown })
	h.ingest([]codec.Task{sched("late", t0.Add(5*time.Second), 1), sched("early", t0.Add(time.Second), 2)})
	h.run()
	for range 6 {
		h.advance(time.Second)
	}
	want := ms(t0.Add(time.Second))
	if st := h.e.Stats(); st.Held != 2 || st.OldestOverdue.UnixMilli() != want {
		t.Errorf("before a restart: held %d, oldest overdue %v, want 2 and %v", st.Held, st.OldestOverdue.Time, t0.Add(time.Second))
	}
	h.reopen()
	if st := h.e.Stats(); st.OldestOverdue.UnixMilli() != want {
		t.Errorf("after a restart: oldest overdue %v, want %v", st.OldestOverdue.Time, t0.Add(time.Second))
	}
	// Released in due order once the target is back.
	h.sink.reset()
	h.sink.setFail(nil)
	h.run()
	h.advance(10 * time.Second)
	if got := h.sink.acked(); !slices.Equal(got, []string{"early", "late"}) {
		t.Fatalf("released %v, want [early late]", got)
	}
}

// collidingTarget returns a target other than t whose held group (for
// transport slot l) is t's.
func collidingTarget(l int, t string) string {
	g := heldGroup(l, t)
	for i := 0; ; i++ {
		c := fmt.Sprintf("coll%d", i)
		if heldGroup(l, c) == g {
			return c
		}
	}
}

// TestHeldPartlyDownGroupDoesNotStrandTheRest: one target ("out"), a Kafka topic
// with one partition down. 40 tasks are held through a full outage; then
// only the first 16 (the down partition's, first in the group's due/seq
// order) keep failing. The 24 others must be delivered: each probe of the
// group starts where the last stopped (they were stranded behind the
// first batch, review).
func TestHeldPartlyDownGroupDoesNotStrandTheRest(t *testing.T) {
	h := holdHarness(t, -1)
	var batch []codec.Task
	for i := range 40 {
		batch = append(batch, sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1)))
	}
	holdTasks(t, h, batch, 40)
	h.sink.setFail(func(tk *codec.Task) error {
		if tk.ID < "t016" { // the down partition's
			return errDown
		}
		return nil
	})
	for range 120 { // two minutes
		h.advance(time.Second)
	}
	got := map[string]bool{}
	for _, id := range h.sink.acked() {
		got[id] = true
	}
	t.Logf("delivered %d of the 24 up tasks; %d delivery attempts in all", len(got), len(h.sink.all()))
	if len(got) != 24 {
		t.Fatalf("%d of the 24 held tasks of the up partition delivered in 2 minutes; the rest stranded behind the down partition's", len(got))
	}
}

// TestHeldCollidingTargetDoesNotStrandTheOther: two targets share a held
// group; the down one's held tasks come first. The up one's are delivered
// while the other stays down (they were stranded, review).
func TestHeldCollidingTargetDoesNotStrandTheOther(t *testing.T) {
	h := holdHarness(t, -1)
	downT := collidingTarget(int(codec.TransportKafka), "out")
	var batch []codec.Task
	for i := range 40 {
		tk := sched(fmt.Sprintf("t%03d", i), t0.Add(time.Second), int64(i+1))
		if i < 16 {
			tk.Target = downT
		}
		batch = append(batch, tk)
	}
	holdTasks(t, h, batch, 40)
	h.sink.setFail(func(tk *codec.Task) error {
		if tk.Target == downT {
			return errDown
		}
		return nil
	})
	// Also deliveries to "out" of tasks that were never held.
	for i := range 5 {
		h.ingest([]codec.Task{sched(fmt.Sprintf("fresh%d", i), t0.Add(time.Duration(10+i)*time.Second), int64(100+i))})
	}
	for range 120 {
		h.advance(time.Second)
	}
	n := 0
	for _, id := range h.sink.acked() {
		if id[0] == 't' {
			n++
		}
	}
	if n != 24 {
		t.Fatalf("%d of the 24 held tasks of the up target %q delivered in 2 minutes (down target %q shares its group)", n, "out", downT)
	}
}
