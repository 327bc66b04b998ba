package shard

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
)

// Releasing what waited for a target once it is back. Through an outage
// each task due for the target waits its own backoff, which grows to
// Retry.Max (5 min by default), and each shard probes its held tasks
// (hold.go) once per its own backoff of the same length. When the target
// came back, the first task to find it so was delivered, but every other
// waited out what was left of its wait: after a 10 min outage the last
// task was delivered 4-5 min late, the held ones shard by shard, and
// readiness said "target unavailable" for up to 2 min (hunt H173).
//
// Now an outage of a target group (heldGroup: transport and a hash of the
// target, as the held tasks are grouped) is recorded for the engine as a
// whole. A batch that delivers a task that waited for the group (one whose
// last failure was ErrUnavailable, or a held one) and fails none of the
// group ends its outage: every shard then takes the group's waiting tasks
// out of its wheel and delivers them at once (in due order, a batch per
// round beside the due tasks), and ends the group's held backoff, so its
// held tasks are released at once too. A batch that does both is a target
// partly down (a Kafka topic with one partition without a leader) and ends
// nothing, as for the held tasks (heldOutcomeLocked).
//
// A group released again soon after a release failed again: a target
// partly down whose healthy part delivered a batch of its own (kafka-go
// fails a whole batch at a partition without a leader, so tasks of healthy
// partitions wait too). So releases of a group are spaced by a wait that
// doubles (Retry.Initial to Retry.Max) each time a failure follows a
// release within twice that wait, and starts again at zero after an
// outage that began well after the last release. A target partly down is
// probed as often as its tasks' backoffs would have, not at every batch.
// A delivery that would have released the group but came too soon is
// remembered: the release goes when the wait ends (the fire loops look,
// releaseOwed) unless the group failed again meanwhile. Else a target
// that failed right after a release and was then back for good left the
// tasks that failed meanwhile to their own backoff (up to Retry.Max): the
// deliveries that found it back came within the wait, and none after it.
//
// A restart keeps it. shard.late is memory, so after a restart during or
// after an outage no task was known to wait for it: each went at its own
// retry time, the last up to Retry.Max after the target's return (hunt
// H178: 300 s; 121 s when restarted 3 min before the return). Now the
// fire commit that retries a task failed as unavailable writes a waiting
// record (appendWaiting: its retry's fire time, due time and group), and
// every commit that takes it out of shard.late otherwise deletes it
// (delivery, dead-lettering, hold, a retry after another failure,
// replace, cancel, drop). Open loads the records (loadWaitingLocked) and
// marks their groups down, so the first delivery of one releases the
// rest. Nothing is written for a task that never failed.

// groupOutages is the engine's record of target groups in an outage.
type groupOutages struct {
	mu sync.Mutex
	m  map[int64]groupOutage
	// owedAt is when the earliest release owed is due (ms, engine
	// clock), 0 if none: the fire loops read it on every round, without
	// the lock. It may be early (the group failed again since), never
	// late.
	owedAt atomic.Int64
	// lastNow is the engine clock (ms) at the fire loops' last look
	// (rebase), to tell a step back.
	lastNow atomic.Int64
	// probeAt is when the next probe round is due (ms, engine clock), 0
	// when no group was down at the last: the fire loops read it on every
	// round, without the lock. lastRound is the one before (under mu):
	// a round probes the groups untried since then (probeOutages).
	probeAt   atomic.Int64
	lastRound int64
}

// groupOutage is one target group's.
type groupOutage struct {
	down     bool          // a task of it failed as unavailable since its last release
	released int64         // when its waiting tasks were last released (ms, engine clock)
	wait     time.Duration // the least time from that release to the next
	// owed: a batch delivered a task that waited for it and failed none
	// of it within the wait, and none has failed since: its release goes
	// when the wait ends.
	owed bool
	// tried is when a task of it last failed as unavailable, or was
	// pulled forward to probe it (ms, engine clock; 0 after a restart):
	// while it is down, a probe round tries one of its waiting tasks when
	// this is older than the round before (probeOutages).
	tried int64
	// unseen counts the probes in a row that found no task of it
	// waiting in any shard's memory and none held on disk (probe): at
	// unseenToForget its outage is forgotten.
	unseen uint8
	// names: the targets whose publish failed as unavailable in this
	// outage, for its lines (a group is a hash bucket, a number an
	// operator cannot use); empty for an outage restored at Open
	// (restored: the waiting records keep the group only) until a task of
	// it fails again.
	names    outageNames
	restored bool
}

// maxOtherTargets bounds the other names an outage keeps beside its first
// (other_targets counts up to it): a group is one of 4096 hash buckets
// of the targets, so more than one target down in one is rare already.
const maxOtherTargets = 16

// unknownRestoredTarget is the target of an outage restored at Open whose
// tasks did not fail again since.
const unknownRestoredTarget = "unknown: outage restored at the restart, whose records keep only the target group"

// outageNames are the targets that failed in a group's outage: the first,
// and up to maxOtherTargets others.
type outageNames struct {
	first  string
	others []string
}

// add notes that target failed.
func (n *outageNames) add(target string) {
	switch {
	case n.first == "":
		n.first = target
	case target == n.first || slices.Contains(n.others, target) || len(n.others) >= maxOtherTargets:
	default:
		n.others = append(n.others, target)
	}
}

// fields are the outage line's fields naming its targets.
func (n outageNames) fields(restored bool) []zap.Field {
	if n.first == "" {
		if restored {
			return []zap.Field{zap.String("target", unknownRestoredTarget)}
		}
		return nil
	}
	f := []zap.Field{zap.String("target", n.first)}
	if len(n.others) > 0 {
		f = append(f, zap.Int("other_targets", len(n.others)))
	}
	return f
}

// downTargets are the targets of a fire batch's tasks that failed as
// unavailable, by target group (deliver).
type downTargets map[int64][]string

// add notes target's failure in group g; it allocates the map.
func (d downTargets) add(g int64, target string) downTargets {
	if d == nil {
		d = make(downTargets)
	}
	if l := d[g]; !slices.Contains(l, target) && len(l) <= maxOtherTargets {
		d[g] = append(l, target)
	}
	return d
}

// unseenToForget is how many probes in a row, probeEvery apart, must find
// nothing waiting for a down group before its outage is forgotten. Its
// waiting tasks all left without a delivery that ended it: cancelled,
// replaced, dead-lettered (or expired past OutageMemory). Else the probe
// rounds ran for as long as the process did, each a scan of every shard's
// waiting tasks (review R189). Two, not one: a first failure that goes
// straight to disk (the late map full) is seen by the held seek only once
// its batch is written, and a probe may look between the shard's unlock
// and that write (the outcome that marks the group down follows it).
// Forgetting wrongly costs little: the next failure of a task of the
// group marks it down again, and until then its tasks (if any) go at
// their own retries (review R193). ("probeEvery apart": a clock stepped
// back brings the next round at once, with the same result.)
const unseenToForget = 2

// released is a waiting task a release is to take out of its shard's
// wheel (shard.released).
type releasedTask struct {
	due int64
	seq uint64
}

// outcome records the outcome of a fire batch whose publish began at
// begin (ms) for the target groups of its tasks that waited for an
// outage: up, the groups of those delivered; down, of those (any) that
// failed as unavailable. It releases the waiting tasks of each group up
// and not down, in every shard, when the group was down. A failure of a
// publish that began before the group's last release is what the target
// said before it was back (a produce kafka-go was still retrying): it does
// not put the group down again. names are the targets that failed, by
// group, for the outage lines. Called without any shard lock.
func (e *Engine) outcome(up, down []int64, names downTargets, begin int64) {
	if len(up) == 0 && len(down) == 0 {
		return
	}
	now := e.nowMs()
	r := e.opts.Retry
	o := &e.outages
	var release []int64
	var waits []time.Duration // of each group released: the least time to its next release
	var gone []groupOutage    // of each group released: its outage, for the line
	o.mu.Lock()
	if o.m == nil {
		o.m = make(map[int64]groupOutage)
	}
	for _, g := range down {
		st := o.m[g]
		if st.released > begin {
			continue
		}
		st.owed = false // failed again: what found it back was wrong
		st.tried = now
		st.unseen = 0
		if o.probeAt.Load() == 0 {
			// The probe rounds start (probeOutages): this group's first
			// comes two rounds on, probeEvery from now.
			o.lastRound = now
			o.probeAt.Store(now + e.probeEvery().Milliseconds()/2)
		}
		if !st.down {
			st.down, st.names, st.restored = true, outageNames{}, false
			if st.released != 0 && now-st.released <= 2*st.wait.Milliseconds()+r.Initial.Milliseconds() {
				// Down again right after a release: partly down, or
				// flapping. The next release waits longer.
				st.wait = min(max(2*st.wait, r.Initial), r.Max)
			} else {
				st.wait = 0
			}
		}
		for _, name := range names[g] {
			st.names.add(name)
		}
		o.m[g] = st
	}
	for _, g := range up {
		st, ok := o.m[g]
		if !ok || !st.down || slices.Contains(down, g) {
			continue
		}
		if at := st.released + st.wait.Milliseconds(); now < at {
			// Too soon after the last release: it goes when the wait
			// ends, unless the group fails before (releaseOwed).
			if !st.owed {
				st.owed = true
				o.m[g] = st
				if next := o.owedAt.Load(); next == 0 || at < next {
					o.owedAt.Store(at)
				}
			}
			continue
		}
		gone = append(gone, st)
		st.down, st.released, st.owed = false, now, false
		st.names, st.restored = outageNames{}, false
		o.m[g] = st
		release = append(release, g)
		waits = append(waits, st.wait)
	}
	if len(release) > 0 {
		o.forgetLocked(now, r.Max)
	}
	o.mu.Unlock()
	e.release(release, waits, gone)
}

// forgetLocked forgets groups up for longer than any wait they keep.
func (o *groupOutages) forgetLocked(now int64, max time.Duration) {
	for g, st := range o.m {
		if !st.down && now-st.released > 2*max.Milliseconds() {
			delete(o.m, g)
		}
	}
}

// rebase moves the groups' last releases (and owedAt) back with the
// clock when it stepped back, as rebaseLocked does the shards' waits:
// else every failure of a group released before the step looks older
// than that release for as long as the step (outcome skips it, and
// releasedSince keeps its tasks at Retry.Initial instead of their outage
// backoff: a down target tried every Retry.Initial), and a release owed
// waits the step out. The fire loops call it on each round, without any
// shard lock.
func (o *groupOutages) rebase(now int64) {
	back := o.lastNow.Swap(now) - now
	if back < stepBackMin.Milliseconds() {
		return
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	next := int64(0)
	for g, st := range o.m {
		if st.released > now {
			st.released = max(math.MinInt64+back, st.released) - back
			o.m[g] = st
		}
		if st.tried > now {
			// Else a down group's probes wait the step out.
			st.tried = max(math.MinInt64+back, st.tried) - back
			o.m[g] = st
		}
		if at := st.released + st.wait.Milliseconds(); st.owed && (next == 0 || at < next) {
			next = at
		}
	}
	o.owedAt.Store(next)
	if at := o.probeAt.Load(); at > now {
		// Else the probe rounds wait the step out.
		o.lastRound = min(o.lastRound, now)
		o.probeAt.Store(min(at, now+1))
	}
}

// releaseOwed releases the groups whose release was owed (outcome) and
// whose wait has ended by now (ms). The fire loops call it on each round,
// without any shard lock, and park no later than owedAt.
func (e *Engine) releaseOwed(now int64) {
	o := &e.outages
	if at := o.owedAt.Load(); at == 0 || now < at {
		return
	}
	var release []int64
	var waits []time.Duration
	var gone []groupOutage
	o.mu.Lock()
	next := int64(0)
	for g, st := range o.m {
		if !st.owed {
			continue
		}
		if at := st.released + st.wait.Milliseconds(); now < at {
			if next == 0 || at < next {
				next = at
			}
			continue
		}
		gone = append(gone, st)
		st.down, st.released, st.owed = false, now, false
		st.names, st.restored = outageNames{}, false
		o.m[g] = st
		release = append(release, g)
		waits = append(waits, st.wait)
	}
	o.owedAt.Store(next)
	if len(release) > 0 {
		o.forgetLocked(now, e.opts.Retry.Max)
	}
	o.mu.Unlock()
	e.release(release, waits, gone)
}

// Probing a target group that is down. Once their backoffs have grown to
// Retry.Max, a target's few waiting tasks found it back only at their own
// next try, up to Retry.Max (5 min by default) after its return, and only
// then went the rest, and readiness said "target unavailable" as long
// (hunt H187: one task waiting through a 30-35 min outage was delivered
// 152 s after the return on average, 296 s at worst; five tasks, 64 s
// and 149 s). Many waiting tasks find it back within seconds, as some of
// them retry all the time, and held ones are probed at most heldProbeMax
// apart. So while a group is down and none of its tasks was tried for
// about probeEvery, the fire loops pull one of its waiting tasks forward:
// the one with the earliest retry (the try that would have come next),
// in one shard, queued and claimed as a released task
// (claimReleasedLocked). The probe is an ordinary retry: an outage
// charges no attempt; delivered, it releases the rest (outcome); failed
// as unavailable again, it waits its outage backoff, its waiting record
// rewritten in the same commit, as for any retry.
//
// Probes go in rounds, probeEvery/2 apart while a group is down, and a
// round probes each down group untried since the round before: so a
// group is tried at most probeEvery after its last try, and probed at
// most once per probeEvery, however many tasks wait and in however many
// shards, and not at all while its tasks' own retries come more often
// (early in an outage, or with many tasks). Finding a group's task scans
// every shard's late map (a few ms at the bound, 65536 per shard): by
// rounds, there are at most two scans per probeEvery, for every group
// due, however many targets are down and when each was last tried, and
// the probes of a round go in one batch per shard and lane.

// probeEvery is the longest a down group goes untried while a task of it
// waits in memory: as the held probes' longest backoff, and never longer
// than the tasks' own (Retry.Max). No doubling from Retry.Initial, as the
// held probes have: the tasks' own backoffs double from it and are
// shorter than this until they are overdue by as long, so a probe comes
// only once they have grown past it.
func (e *Engine) probeEvery() time.Duration {
	return min(e.opts.Retry.Max, heldProbeMax)
}

// probeOutages runs a probe round when one is due (see above): it pulls
// forward one waiting task of each down group untried since the round
// before. A group whose release is owed is left to it. The fire loops
// call it on each round, without any shard lock, and park no later than
// probeAt (unless paused).
func (e *Engine) probeOutages(now int64) {
	o := &e.outages
	if at := o.probeAt.Load(); at == 0 || now < at || e.paused.Load() {
		// Paused, nothing is claimed (and nothing tried): the first
		// round after the pause probes what is due by then.
		return
	}
	half := max(e.probeEvery().Milliseconds()/2, 1)
	var gs []int64
	o.mu.Lock()
	at := o.probeAt.Load()
	if at == 0 || now < at {
		o.mu.Unlock()
		return // another loop ran it
	}
	anyDown := false
	for g, st := range o.m {
		if !st.down || st.owed {
			continue
		}
		anyDown = true
		if st.tried < o.lastRound {
			// Counted as tried whether or not a task is found: a group
			// whose waiting tasks all left (or are held, and probed by
			// hold.go) is looked for once per probeEvery, not each round,
			// and one with none left is forgotten after unseenToForget
			// looks (forgetUnseen).
			st.tried = now
			o.m[g] = st
			gs = append(gs, g)
		}
	}
	switch {
	case !anyDown:
		o.lastRound = 0
		o.probeAt.Store(0) // until a group goes down (outcome)
	case now-at >= half:
		// The loops were held up past a whole interval: from now.
		o.lastRound = now
		o.probeAt.Store(now + half)
	default:
		// On the rounds' own times, not when a loop came to them: a
		// group probed in this round was tried at or after at, so it is
		// not probed in the next.
		o.lastRound = at
		o.probeAt.Store(at + half)
	}
	o.mu.Unlock()
	if len(gs) > 0 {
		e.probe(gs, now)
	}
}

// probe queues, for each group of gs, its waiting task with the earliest
// retry over every shard to be claimed at once as a released task. Each
// shard's late map is scanned once, under its lock, for all of gs. Called
// without any shard lock, at now (ms, engine clock).
func (e *Engine) probe(gs []int64, now int64) {
	best := make([]probeCandidate, len(gs))
	seen := make([]bool, len(gs))
	// By group: with many groups down (a whole cluster), an index a
	// waiting task would cost len(gs) a task.
	at := make(map[int64]int, len(gs))
	for i, g := range gs {
		at[g] = i
	}
	for _, s := range e.shards {
		s.mu.Lock()
		s.probeCandidatesLocked(at, best, seen, now)
		s.mu.Unlock()
	}
	if slices.Contains(seen, false) {
		// Held ones wait too (hold.go probes them): a seek a shard, for
		// each group with none waiting in memory only.
		for _, s := range e.shards {
			s.markHeldGroups(gs, seen)
		}
	}
	e.forgetUnseen(gs, seen, now)
	for i, c := range best {
		if c.s == nil {
			continue // none waits in memory (held ones are probed by hold.go)
		}
		if h := e.testHookProbe; h != nil {
			h(gs[i], c.seq)
		}
		s := c.s
		s.mu.Lock()
		// Checked anew at the claim, as a release's: it may be gone by then.
		s.released = append(s.released, releasedTask{due: c.due, seq: c.seq})
		s.parked = false // as addLocked: busy until the loop looked
		s.mu.Unlock()
		s.wake()
	}
}

// forgetUnseen counts, for each probed group of gs still down, whether
// its probe saw a task of it waiting (seen: in a shard's memory or held
// on disk), and forgets the outage of a group unseen by unseenToForget
// probes in a row: nothing waits for it any more, and the probe rounds
// stop once no group is down. Its entry goes too unless a recent
// release's spacing is still to be kept (forgetLocked's rule).
func (e *Engine) forgetUnseen(gs []int64, seen []bool, now int64) {
	o := &e.outages
	var gone []int64
	var outs []groupOutage
	o.mu.Lock()
	for i, g := range gs {
		st, ok := o.m[g]
		if !ok || !st.down || st.owed {
			continue
		}
		switch {
		case seen[i]:
			st.unseen = 0
		case st.unseen+1 < unseenToForget:
			st.unseen++
		default:
			gone, outs = append(gone, g), append(outs, st)
			st.down, st.unseen = false, 0
			st.names, st.restored = outageNames{}, false
			if now-st.released > 2*e.opts.Retry.Max.Milliseconds() {
				delete(o.m, g)
				continue
			}
		}
		o.m[g] = st
	}
	o.mu.Unlock()
	for i, g := range gone {
		e.log.Info("no task waits for a target group that was down any more (cancelled, replaced or dead-lettered): its outage is no longer tracked",
			append([]zap.Field{zap.Stringer("transport", codec.Transport(heldSlot(g))), zap.Int("target_group", int(g>>heldDueBits&(1<<heldGroupBits-1)))},
				outs[i].names.fields(outs[i].restored)...)...)
	}
}

// probeCandidate is a waiting task a probe may pull forward.
type probeCandidate struct {
	s    *shard // nil: none found
	fire int64
	due  int64
	seq  uint64
}

// probeCandidatesLocked sets seen[at[g]] for each group g with a task
// waiting in the shard, and updates best[at[g]] with its waiting task
// with the earliest retry that a release could claim now:
// not in flight, being deleted or waiting for its retry to be durable,
// and in the wheel or past the horizon; and due by now (ms). One due
// later (the clock stepped back past its due time) would go early, and
// failed again it waited its outage backoff from a negative overdue,
// Retry.Initial: it was tried every Retry.Initial against the down
// target until the clock was back at its due time (review R189: 599
// tries in 10 min after a 1 h step back, for one task). It waits the
// step out as its own retry does (rebaseLocked).
func (s *shard) probeCandidatesLocked(at map[int64]int, best []probeCandidate, seen []bool, now int64) {
	for seq, lt := range s.late {
		g := lt.group()
		if g == 0 {
			continue
		}
		i, ok := at[g]
		if ok {
			seen[i] = true
		}
		if !ok || lt.due() > now || best[i].s != nil && (lt.fire > best[i].fire || lt.fire == best[i].fire && seq > best[i].seq) {
			continue
		}
		if _, ok := s.inflight[seq]; ok {
			continue
		}
		if _, ok := s.deleting[seq]; ok {
			continue
		}
		if _, ok := s.unwheeled[seq]; ok {
			continue
		}
		if lt.h == 0 && s.belowHorizonLocked(lt.fire, seq) {
			continue // neither in the wheel nor only in the store: not claimable
		}
		best[i] = probeCandidate{s: s, fire: lt.fire, due: lt.due(), seq: seq}
	}
}

// release takes the waiting tasks of the groups gs out of every shard's
// wheel to be delivered at once; waits are their next releases' least
// waits and outs their outages, for the log. Called without any shard
// lock.
func (e *Engine) release(gs []int64, waits []time.Duration, outs []groupOutage) {
	if len(gs) == 0 {
		return
	}
	if h := e.testHookRelease; h != nil {
		h(gs)
	}
	waiting := 0
	for _, s := range e.shards {
		s.mu.Lock()
		rel := s.releaseLocked(gs)
		waiting += len(rel)
		if len(rel) > 0 {
			// Sorted without the lock (for 65536 tasks, the default
			// bound per shard, the sort takes about 4 times the scan's
			// 1-8 ms, BenchmarkReleaseScan on a loaded 2-core machine):
			// an ingest into the shard waits for the scan only.
			// The claim checks each one anew, so the list may be stale.
			s.mu.Unlock()
			sortReleased(rel)
			s.mu.Lock()
			s.released = append(s.released, rel...)
		}
		s.parked = false // as addLocked: busy until the loop looked
		s.mu.Unlock()
		s.wake()
	}
	for i, g := range gs {
		// One line per release: releases of a group are spaced.
		e.log.Info("target back after an outage: the tasks that waited for it go now, in every shard",
			append([]zap.Field{zap.Stringer("transport", codec.Transport(heldSlot(g))), zap.Int("target_group", int(g>>heldDueBits&(1<<heldGroupBits-1))),
				zap.Int("waiting_in_memory", waiting), zap.Duration("next_release_after", waits[i])},
				outs[i].names.fields(outs[i].restored)...)...)
	}
}

// releasedSince reports whether group g's waiting tasks were released
// after begin (ms): a publish that began before failed with what the
// target said before it was back. (One that began in the same ms counts
// as after: the released tasks' own publishes begin then.)
func (e *Engine) releasedSince(g, begin int64) bool {
	o := &e.outages
	o.mu.Lock()
	defer o.mu.Unlock()
	st, ok := o.m[g]
	return ok && st.released > begin
}

// releaseLocked ends the outage of the groups gs in the shard: their held
// backoff ends. It returns their waiting tasks, to be queued (in
// s.released, after sortReleased) to be taken out of the wheel and
// delivered at once (claimReleasedLocked).
func (s *shard) releaseLocked(gs []int64) []releasedTask {
	for _, g := range gs {
		s.lanes[heldSlot(g)].hold.endBackoff(g)
	}
	var rel []releasedTask
	for seq, lt := range s.late {
		if g := lt.group(); g != 0 && slices.Contains(gs, g) {
			rel = append(rel, releasedTask{due: lt.due(), seq: seq})
		}
	}
	return rel
}

// sortReleased puts released tasks oldest first, as the held ones are
// released.
func sortReleased(rel []releasedTask) {
	slices.SortFunc(rel, func(a, b releasedTask) int {
		return cmp.Or(cmp.Compare(a.due, b.due), cmp.Compare(a.seq, b.seq))
	})
}

// claimReleasedLocked claims up to limit queued released tasks: one in
// the wheel is taken out of it; one whose retry is past the horizon (a
// Retry.Max longer than half the horizon) is only in the store, and the
// loader skips it while it is claimed. One whose retry is not durable yet
// (it failed just before the release; the lane's next batch does not wait
// for the fsync) stays queued until it is: the durable batch wakes the
// loop. One that left the wheel meanwhile (claimed, delivered, failed
// again, replaced or cancelled) or that an undurable replace or cancel is
// deleting (it stays in the wheel, as claimLocked leaves it) is skipped.
func (s *shard) claimReleasedLocked(limit int) []fireItem {
	var out []fireItem
	var undurable []releasedTask
	k := 0
	for ; k < len(s.released) && len(out) < limit; k++ {
		r := s.released[k]
		lt, ok := s.late[r.seq]
		if !ok || lt.group() == 0 {
			continue
		}
		if _, claimed := s.inflight[r.seq]; claimed {
			continue
		}
		if _, deleting := s.deleting[r.seq]; deleting {
			continue
		}
		if _, queued := s.unwheeled[r.seq]; queued {
			undurable = append(undurable, r)
			continue
		}
		switch {
		case lt.h != 0:
			if !s.w.Remove(lt.h) {
				continue // the handle is stale: its entry was yielded
			}
			lt.h = 0
			s.late[r.seq] = lt
		case !s.belowHorizonLocked(lt.fire, r.seq):
		default:
			continue // neither in the wheel nor in the store past the horizon
		}
		out = append(out, fireItem{fire: lt.fire, seq: r.seq, released: true})
		s.inflight[r.seq] = notSuperseded
	}
	s.released = append(undurable, s.released[k:]...)
	if len(s.released) == 0 {
		s.released = nil
	}
	if len(out) > 0 {
		s.inWheelG.Set(float64(s.w.Len()))
	}
	return out
}

// releasedReadyLocked reports whether a queued released task may be
// claimed now: the queue left by claimReleasedLocked holds the tasks
// whose retry was not durable yet, and a durable batch drained since may
// have made one so.
func (s *shard) releasedReadyLocked() bool {
	if s.e.paused.Load() {
		return false
	}
	for _, r := range s.released {
		if _, queued := s.unwheeled[r.seq]; !queued {
			return true
		}
	}
	return false
}

// holdAtOpenBatchBytes bounds the batches in which loadWaitingLocked
// moves the tasks waiting past Options.OutageMemory to the held range
// (each with its value): a fire round's bytes (DefaultFireBatchBytes).
var holdAtOpenBatchBytes = DefaultFireBatchBytes

// testHookHoldAtOpenCommit sees the size of each batch loadWaitingLocked
// commits.
var testHookHoldAtOpenCommit func(size int)

// loadWaitingLocked reads the shard's waiting records at Open (the fire
// commit of a task that failed as unavailable writes one with its retry,
// and whatever deletes or moves the task deletes it): each such task is
// known to wait for the outage again (shard.late, with its group), and
// its group is down for the engine, so the first delivery of one of them
// releases the rest, as without the restart. Before, the tasks went each
// at its own retry time, up to Retry.Max after the target's return. A
// record whose task is not stored at its retry's key any more (a build
// without these records, which ignores them, delivered, replaced or
// retried it) and a corrupt one are deleted. So are those past
// Options.OutageMemory (retry.waiting_in_memory lowered since), whose
// tasks are held on disk (holdAtOpen), as the fire loop holds the next
// task that fails as unavailable once the bound is reached: they go with
// their group's release. Before, they went each at its retry time, up to
// Retry.Max after the target's return (hunt H203). Keys only are read
// for the tasks kept in memory: one seek per record in key order, and
// nothing without an outage.
func (s *shard) loadWaitingLocked() error {
	it, err := s.e.db.NewIter(&pebble.IterOptions{
		LowerBound: shardSeqKey(prefixWaiting, s.id, 0),
		UpperBound: shardSeqKey(prefixWaiting, s.id+1, 0),
	})
	if err != nil {
		return fmt.Errorf("load waiting tasks of shard %d: %w", s.id, err)
	}
	type record struct {
		seq      uint64
		fire, dg int64
	}
	var recs []record
	var drop [][]byte
	for ok := it.First(); ok; ok = it.Next() {
		v, err := it.ValueAndErr()
		if err != nil {
			it.Close()
			return fmt.Errorf("load waiting tasks of shard %d: %w", s.id, err)
		}
		_, seq, fire, dg, ok := parseWaiting(it.Key(), v)
		if !ok {
			drop = append(drop, slices.Clone(it.Key()))
			continue
		}
		recs = append(recs, record{seq: seq, fire: fire, dg: dg})
	}
	if err := it.Close(); err != nil {
		return fmt.Errorf("load waiting tasks of shard %d: %w", s.id, err)
	}
	if len(recs) == 0 && len(drop) == 0 {
		return nil
	}
	// The earliest retries first: those are kept within the bound.
	slices.SortFunc(recs, func(a, b record) int { return cmp.Or(cmp.Compare(a.fire, b.fire), cmp.Compare(a.seq, b.seq)) })
	tasksOpts := &pebble.IterOptions{LowerBound: taskBound(s.id, 0), UpperBound: taskBound(s.id, heldBase)}
	tasks, err := s.e.db.NewIter(tasksOpts)
	if err != nil {
		return fmt.Errorf("load waiting tasks of shard %d: %w", s.id, err)
	}
	if s.late == nil {
		s.late = make(map[uint64]lateTask, min(len(recs), s.e.opts.OutageMemory))
	}
	var groups []int64
	var key []byte
	b := s.e.db.NewBatch()
	defer func() { b.Close() }()
	var held [transportSlots]int64
	nHeld, nDropped, nCorrupt := int64(0), 0, 0
	// commit writes b, not synced: a record left by a crash is dropped (a
	// task held) again at the next Open. Each batch is atomic for the
	// tasks it moves: a task moved to the held range is there with its
	// index entry, its count and no record, or where it was with its
	// record. The moves are committed every holdAtOpenBatchBytes: each
	// carries the task's whole value, and one batch for all of them held
	// the values of up to the old bound's tasks in memory at once, the
	// memory a lowered bound is meant to spare (and from 4 GiB Pebble
	// panics: TestWaitingOverLoweredBoundBatched).
	commit := func() error {
		for l, n := range held {
			if n > 0 {
				b.Merge(heldKey(s.id, l), u64(uint64(n)), nil)
				nHeld += n
			}
		}
		held = [transportSlots]int64{}
		for _, k := range drop {
			b.Delete(k, nil)
		}
		nDropped += len(drop)
		drop = drop[:0]
		if b.Empty() {
			return nil
		}
		if h := testHookHoldAtOpenCommit; h != nil {
			h(len(b.Repr()))
		}
		if err := safeCall(func() error { return b.Commit(pebble.NoSync) }); err != nil {
			return fmt.Errorf("delete stale waiting records of shard %d: %w", s.id, err)
		}
		b.Close()
		b = s.e.db.NewBatch()
		return nil
	}
	for _, r := range recs {
		key = appendTaskKey(key[:0], s.id, r.fire, r.seq)
		if !tasks.SeekGE(key) || !bytes.Equal(tasks.Key(), key) {
			// A seek that failed is not a task gone, and Pebble clears
			// the error at the next seek: it is checked here, before a
			// commit below deletes the record (its task went at its own
			// retry then, not with its group's release).
			if err := tasks.Error(); err != nil {
				tasks.Close()
				return fmt.Errorf("load waiting tasks of shard %d: seek task %d: %w", s.id, r.seq, err)
			}
			drop = append(drop, waitingKey(s.id, r.seq))
			continue
		}
		if len(s.late) >= s.e.opts.OutageMemory {
			slot, ok, err := s.holdAtOpen(b, tasks, r.fire, r.seq)
			switch {
			case err != nil && pebble.IsCorruptionError(err):
				// It never reads: left where it is, for the fire loop to
				// report (TestCorruptValueAtFire). The iterator kept the
				// error for every value read after it (each taken as
				// corrupt too): a new one for the rest.
				if nCorrupt++; nCorrupt == 1 {
					// Once a shard: a corrupt block holds many values.
					s.e.log.Warn("a task waiting for an outage past retry.waiting_in_memory cannot be read; left at its retry time",
						zap.Int("shard", s.id), zap.Uint64("seq", r.seq), zap.Error(err))
				}
				tasks.Close()
				if tasks, err = s.e.db.NewIter(tasksOpts); err != nil {
					return fmt.Errorf("load waiting tasks of shard %d: %w", s.id, err)
				}
			case err != nil:
				// Not a task gone: the load fails rather than delete the
				// record of a task it could not look at.
				tasks.Close()
				return fmt.Errorf("load waiting tasks of shard %d: hold task %d: %w", s.id, r.seq, err)
			}
			drop = append(drop, waitingKey(s.id, r.seq))
			if ok {
				held[slot]++
				if len(b.Repr()) >= holdAtOpenBatchBytes {
					if err := commit(); err != nil {
						tasks.Close()
						return err
					}
				}
			}
			continue
		}
		lt := lateTask{dg: r.dg}
		s.noteLateLocked(r.seq, lt.due(), r.fire, lt.group())
		if g := lt.group(); !slices.Contains(groups, g) {
			groups = append(groups, g)
		}
	}
	if len(s.late) == 0 {
		s.late = nil
	}
	if err := errors.Join(tasks.Error(), tasks.Close()); err != nil {
		return fmt.Errorf("load waiting tasks of shard %d: %w", s.id, err)
	}
	if err := commit(); err != nil {
		return err
	}
	s.e.restoreOutages(groups)
	if len(s.late) > 0 || nHeld > 0 || nCorrupt > 0 {
		s.e.log.Info("tasks waiting since before the restart for an unreachable target; all go once one of them is delivered",
			zap.Int("shard", s.id), zap.Int("waiting_in_memory", len(s.late)), zap.Int("target_groups", len(groups)),
			zap.Int64("held_past_waiting_in_memory", nHeld), zap.Int("stale_records_dropped", nDropped-int(nHeld)-nCorrupt),
			zap.Int("unreadable_left_at_retry", nCorrupt))
	}
	return nil
}

// holdAtOpen adds to b the move of the task at tasks' key (fire, seq), one
// that waited for an outage past Options.OutageMemory, to the held range,
// with its index entry, as the fire loop's hold does; it returns the
// transport slot to count it in. ok is false for a task it leaves where it
// is (at its retry time): a dead letter (never held), one that does not
// decode, or one whose index entry is not this key. A read that fails
// (its value, its index entry) is an error.
func (s *shard) holdAtOpen(b *pebble.Batch, tasks *pebble.Iterator, fire int64, seq uint64) (slot int, ok bool, err error) {
	v, err := tasks.ValueAndErr()
	if err != nil {
		return 0, false, fmt.Errorf("read value: %w", err)
	}
	var t codec.Task
	if codec.DecodeTask(v, &t) != nil || t.Kind == codec.KindDeadLetter {
		return 0, false, nil
	}
	ik := appendIndexKey(nil, t.Source, t.ID)
	iv, found, err := getCopy(s.e.db, ik)
	if err != nil {
		return 0, false, fmt.Errorf("read index entry: %w", err)
	}
	var ie indexEntry
	if !found || decodeIndexEntry(iv, &ie) != nil || ie.Cancel || ie.Shard != s.id || ie.Fire != fire || ie.Seq != seq {
		return 0, false, nil
	}
	slot = transportSlot(t.Transport)
	ie.Fire = heldFire(slot, t.Target, t.Due)
	b.Delete(tasks.Key(), nil)
	b.Set(appendTaskKey(nil, s.id, ie.Fire, seq), v, nil)
	b.Set(ik, appendIndexEntry(nil, &ie), nil)
	return slot, true, nil
}

// restoreOutages records the target groups gs as down (Open: tasks have
// waited for them since before the restart), so that the first delivery
// of a task that waited for one of them releases the rest (outcome).
func (e *Engine) restoreOutages(gs []int64) {
	if len(gs) == 0 {
		return
	}
	o := &e.outages
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.m == nil {
		o.m = make(map[int64]groupOutage)
	}
	for _, g := range gs {
		st := o.m[g]
		if !st.down {
			st.names, st.restored = outageNames{}, true
		}
		st.down = true
		o.m[g] = st
	}
	// Untried since the restart (tried 0): each is probed in the first
	// probe round, at the fire loops' first round, as the target may
	// have come back meanwhile.
	o.lastRound = max(o.lastRound, 1)
	o.probeAt.Store(1)
}
