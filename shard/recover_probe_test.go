package shard

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

// TestFewWaitingTasksProbeTheirTarget: a target with few waiting tasks
// (a low-volume target, nothing new coming due) down for half an hour.
// Their backoffs had grown to Retry.Max, so the target's return was found
// only at the next of their own tries, and only then did the rest go:
// one task was delivered 126 s and 296 s after the return (outages of 30
// and 32m10s), five 149 s after (33m41s), and readiness said "target
// unavailable" as long (hunt H187; 152 s on average for one task over
// returns 13 s apart). Now a down group untried for probeEvery has one
// waiting task pulled forward: each is delivered, and readiness back,
// within probeEvery of the return. The probes add at most one try per
// group per probeEvery (here two targets' groups, each probed on its
// own), charge no attempt, and keep the waiting records exactly the
// tasks waiting.
func TestFewWaitingTasksProbeTheirTarget(t *testing.T) {
	for _, tc := range []struct {
		name    string
		n       int
		targets []string
		outage  time.Duration
	}{
		{"one task, 30 min", 1, []string{"out"}, 30 * time.Minute},
		{"one task, 32m10s", 1, []string{"out"}, 32*time.Minute + 10*time.Second},
		{"five tasks, 33m41s", 5, []string{"out"}, 33*time.Minute + 41*time.Second},
		{"two targets, two tasks each, 32m10s", 4, []string{"out", "other"}, 32*time.Minute + 10*time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, func(o *Options) { o.Retry = defaultLikeRetry })
			every := h.e.probeEvery()
			if every != heldProbeMax {
				t.Fatalf("probeEvery = %v with the default policy, want %v", every, heldProbeMax)
			}
			var groups []int64
			for _, tg := range tc.targets {
				groups = append(groups, heldGroup(transportSlot(codec.TransportKafka), tg))
			}
			if len(slices.Compact(slices.Clone(groups))) != len(groups) {
				t.Fatalf("targets %v share a group", tc.targets)
			}
			var mu sync.Mutex
			probes := map[int64]int{} // by group, in the window
			counting := false
			h.e.testHookProbe = func(g int64, _ uint64) {
				mu.Lock()
				if counting {
					probes[g]++
				}
				mu.Unlock()
			}
			down := fmt.Errorf("broker down: %w", ErrUnavailable)
			h.sink.setFail(func(*codec.Task) error { return down })
			h.run()
			tasks := dueAtT0(tc.n)
			for i := range tasks {
				tasks[i].Target = tc.targets[i%len(tc.targets)]
			}
			h.ingest(tasks)
			// The outage, a second at a time: the fire loops see every
			// probe time as it comes.
			window := 10 * time.Minute // the tries of its last 10 min are counted
			var before int
			for s := range int(tc.outage / time.Second) {
				if time.Duration(s)*time.Second == tc.outage-window {
					before = len(h.sink.all())
					mu.Lock()
					counting = true
					mu.Unlock()
				}
				h.advance(time.Second)
			}
			if len(h.sink.acked()) != 0 {
				t.Fatal("delivered during the outage")
			}
			checkWaitingRecords(t, h.e)
			if got := waitingRecords(t, h.e); got != int64(tc.n) {
				t.Fatalf("%d waiting records after the outage, want %d", got, tc.n)
			}
			// Every task's own backoff is at Retry.Max by then: at most
			// two own tries each in the window, and a probe per group
			// per probeEvery (one more for where the window cuts).
			tries := len(h.sink.all()) - before
			if max := len(groups)*(int(window/every)+1) + 2*tc.n; tries > max {
				t.Fatalf("%d tries in the outage's last %v, want at most %d: more than one probe per group per %v", tries, window, max, every)
			}
			mu.Lock()
			for _, g := range groups {
				if probes[g] == 0 || probes[g] > int(window/every)+1 {
					t.Fatalf("group %x probed %d times in the outage's last %v, want 1 to %d (every %v)", g, probes[g], window, int(window/every)+1, every)
				}
			}
			mu.Unlock()
			if h.e.outageErr() == nil {
				t.Fatal("no outage reported while the target was down")
			}
			h.sink.setFail(nil)
			steps := 0
			for len(h.sink.acked()) < tc.n || h.e.outageErr() != nil {
				if steps++; steps > 301 {
					break
				}
				h.advance(time.Second)
			}
			t.Logf("%d tasks delivered, readiness back, %ds after the return; %d tries in the outage's last %v", len(h.sink.acked()), steps, tries, window)
			if limit := int(every/time.Second) + 1; steps > limit {
				t.Fatalf("%d of %d tasks delivered, outage reported %v, %ds after the target's return; want all and no outage within %ds (probeEvery)",
					len(h.sink.acked()), tc.n, h.e.outageErr(), steps, limit)
			}
			acked := h.sink.acked()
			slices.Sort(acked)
			if len(slices.Compact(acked)) != tc.n {
				t.Fatalf("delivered %v: a task twice", h.sink.acked())
			}
			for _, d := range h.sink.all() {
				if d.Attempts != 0 {
					t.Fatalf("%s tried with %d attempts charged: an outage charges none", d.ID, d.Attempts)
				}
			}
			checkWaitingRecords(t, h.e)
			if got := waitingRecords(t, h.e); got != 0 {
				t.Fatalf("%d waiting records left once every task was delivered", got)
			}
			h.checkPending()
		})
	}
}
