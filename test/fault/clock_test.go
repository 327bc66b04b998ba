package fault

import (
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/bridge/service"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/clock"
)

// TestWallClockSteps steps the bridge's wall clock forward by hours and
// back by minutes. Nothing may be lost, and nothing may fire before its
// due time by the wall clock: after a step back, tasks due between the new
// and the old time wait until the clock passes their due again.
func TestWallClockSteps(t *testing.T) {
	t.Parallel()
	b := newBrokers(t, 0)
	t0 := time.Now().Truncate(time.Millisecond)
	clk := clock.NewFake(t0)
	col := b.collectAt(t, clk.Now)
	ip := newInproc(t, b, clk, nil)
	run := ip.start()
	pub := newPublisher(t, b)
	at := func(base time.Duration) func(int) []string {
		return func(i int) []string {
			return []string{codec.HeaderAt, t0.Add(base + time.Duration(i)*time.Second).UTC().Format(time.RFC3339Nano)}
		}
	}
	const n = 20 // per transport and group
	early := pub.send("early", n, at(10*time.Minute))
	mid := pub.send("mid", n, at(3*time.Hour))
	late := pub.send("late", n, at(5*time.Hour))
	waitPending(t, run.svc, 6*n)

	// Forward by four hours: early and mid are due, late is not.
	clk.Set(t0.Add(4 * time.Hour))
	waitDelivered(t, col, append(append([]string{}, early...), mid...), "after the step forward")
	settle(t, run.svc, clk)
	if lost, _ := lostAndDups(col, late); len(lost) != len(late) {
		t.Errorf("%d tasks due at +5h delivered at +4h", len(late)-len(lost))
	}

	// Back by ten minutes; tasks due between the new and the old time.
	clk.Set(t0.Add(4*time.Hour - 10*time.Minute))
	back := pub.send("back", n, at(4*time.Hour-5*time.Minute))
	waitPending(t, run.svc, 4*n)
	settle(t, run.svc, clk)
	if lost, _ := lostAndDups(col, back); len(lost) != len(back) {
		t.Errorf("%d tasks delivered before their due after the clock stepped back", len(back)-len(lost))
	}
	clk.Set(t0.Add(4*time.Hour - 4*time.Minute))
	if !waitFor(30*time.Second, func() bool { lost, _ := lostAndDups(col, back); return len(lost) == 0 }) {
		st := run.svc.Engine().Stats()
		t.Errorf("after the step back, tasks due in between are not delivered once the clock passes their due: "+
			"bridge time %v, engine stats: pending %d, next due %v, oldest overdue %v, horizon %v, armed timers %d",
			clk.Now().UTC(), st.Pending, st.NextDue, st.OldestOverdue, st.Horizon, clk.Timers())
		for _, ss := range st.Shards {
			t.Logf("shard %d: pending %d in wheel %d next %v overdue %v", ss.Shard, ss.Pending, ss.InWheel, ss.NextDue, ss.OldestOverdue)
		}
		// Does time moving on free them?
		clk.Set(t0.Add(4*time.Hour + 2*time.Minute))
		if waitFor(30*time.Second, func() bool { lost, _ := lostAndDups(col, back); return len(lost) == 0 }) {
			t.Logf("they were delivered once the clock passed the time before the step back (+4h)")
		}
	}
	waitDelivered(t, col, back, "after the clock passed their due again")
	clk.Set(t0.Add(6 * time.Hour))
	all := append(append(append(append([]string{}, early...), mid...), late...), back...)
	waitDelivered(t, col, all, "at the end")

	early2 := 0
	for v, ds := range col.byValue(isTarget) {
		for _, d := range ds {
			due, err := time.Parse(time.RFC3339Nano, d.headers[codec.HeaderDue])
			if err != nil {
				t.Fatalf("%s: delay-due %q: %v", v, d.headers[codec.HeaderDue], err)
			}
			if d.at.Before(due) {
				early2++
				t.Errorf("%s delivered at %v by the bridge clock, before its due %v", v, d.at, due)
			}
		}
	}
	lost, dups := lostAndDups(col, all)
	t.Logf("%d tasks: %d lost, %d duplicates, %d early", len(all), len(lost), dups, early2)
	if st := run.svc.Engine().Stats(); st.Pending != 0 {
		t.Errorf("%d tasks still pending", st.Pending)
	}
	if err := run.stop(); err != nil {
		t.Errorf("bridge: %v", err)
	}
}

func waitPending(t *testing.T, svc *service.Service, n int64) {
	t.Helper()
	var p int64
	if !waitFor(time.Minute, func() bool { p = svc.Engine().Stats().Pending; return p == n }) {
		t.Fatalf("%d tasks pending, want %d", p, n)
	}
}

// settle waits until the engine has delivered everything due at the
// current bridge time.
func settle(t *testing.T, svc *service.Service, clk *clock.Fake) {
	t.Helper()
	if !waitFor(time.Minute, func() bool {
		st := svc.Engine().Stats()
		return st.OldestOverdue.IsZero() && (st.NextDue.IsZero() || st.NextDue.After(clk.Now()))
	}) {
		t.Fatalf("engine did not settle: %+v at %v", svc.Engine().Stats(), clk.Now())
	}
}
