package nats

// A randomized model-based test of floorState (the floor, the barrier and
// the held spans) as Source.process and Source.Run drive it, against a
// model of a JetStream durable pull consumer with explicit acks
// (nats-server v2.15 consumer.go: getNextMsg, deliverMsg, trackPending,
// processAckMsg/moveAckFloor, processNak, checkPending), shared by one or
// two bridge instances, each with its own store.
//
// Safety: every see that says held names a message durably in some
// instance's store. Liveness: once faults stop, every matching message is
// stored. Duplicates (a message stored twice) are classified; with one
// instance (the supported deployment), a duplicate is only allowed when
// more than heldSlots disjoint spans were needed after its first store.
//
// Events (weights drawn per seed): publish (some messages outside the
// filter); deliver (a redelivery from the queue, in any order, else the
// next first delivery in stream order; to an instance, lost in transit, or
// to a down instance); see (a prefix of the instance's buffer, 1..8
// messages); commit (items, floor and held slots in one store write);
// acks (each applied, lost, or delayed and applied or lost later, also
// after a redelivery); AckWait expiry (any pending message, also one in a
// batch being handled: the keep-alive is not modelled); crash (kill -9 in
// any phase); stop (ctx ended: the buffer and an unhandled batch nakked,
// some naks lost; or the ingest durable while Handle returns ctx's error);
// restart (floor and held slots from the store, start from consumer
// info); iterator restart (buffer nakked, start again, same floorState);
// pull reset (buffer kept as set aside, resumed from consumer info);
// ack floor polls after a batch while a barrier is up. The naks of what
// floorState finds delivered and never received (Source.nakUnseen) follow
// start, see and resumed as in the Source, each possibly lost.
// Not modelled: server markers, streams created again or restored
// (checkRestored, incarnations), legacy floors, consumer reset or
// recreation, server restarts and leader changes, MaxAckPending, stream
// limits deleting messages, dead-letter waits.

import (
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/delaybridge/delaybridge/shard"
)

// A few seconds by default; hunt with e.g.
//
//	go test -run 'TestFloorModel$' ./bridge/nats/ -floormodel.seeds=200000
//	go test -run 'TestFloorModel$' ./bridge/nats/ -floormodel.seeds=20000 -floormodel.events=2000 -floormodel.maxinst=3
//
// and replay a failing seed with -run TestFloorModelDump -floormodel.dump=SEED.
var modelSeeds = flag.Int("floormodel.seeds", 4000, "seeds for TestFloorModel")
var modelEvents = flag.Int("floormodel.events", 300, "random events per seed")
var modelMaxInst = flag.Int("floormodel.maxinst", 2, "run with 1 up to this many bridge instances")

// ---- server-side consumer model ----

type mDelivery struct {
	seq  int64
	dseq uint64
	dc   uint64 // NumDelivered
}

type mPending struct{ odseq uint64 } // original delivery sequence

type mServer struct {
	match   []bool // match[seq-1]: the message matches the consumer's filter
	sseq    int64  // o.sseq: next stream sequence to consider
	dseq    uint64 // o.dseq: next delivery sequence
	adflr   uint64
	asflr   int64
	pending map[int64]mPending
	rdc     map[int64]uint64
	rdq     []int64
	acked   map[int64]bool
}

func newServer() *mServer {
	return &mServer{sseq: 1, dseq: 1, pending: map[int64]mPending{}, rdc: map[int64]uint64{}, acked: map[int64]bool{}}
}

func (s *mServer) publish(match bool) int64 {
	s.match = append(s.match, match)
	return int64(len(s.match))
}

// next is getNextMsg + deliverMsg: a redelivery first (any of the queue),
// else the next first delivery in stream order. ok false: nothing to send.
func (s *mServer) next(r *rand.Rand) (mDelivery, bool) {
	var seq int64
	var dc uint64 = 1
	if len(s.rdq) > 0 {
		i := r.IntN(len(s.rdq))
		seq = s.rdq[i]
		s.rdq = slices.Delete(s.rdq, i, i+1)
		s.rdc[seq]++
		dc = s.rdc[seq] + 1
	} else {
		for seq = s.sseq; seq <= int64(len(s.match)) && !s.match[seq-1]; seq++ {
		}
		if seq > int64(len(s.match)) {
			return mDelivery{}, false
		}
		s.sseq = seq + 1
	}
	d := mDelivery{seq: seq, dseq: s.dseq, dc: dc}
	s.dseq++
	if _, ok := s.pending[seq]; !ok {
		s.pending[seq] = mPending{odseq: d.dseq}
	}
	return d, true
}

func (s *mServer) inRdq(seq int64) bool { return slices.Contains(s.rdq, seq) }

// ack is processAckMsg (AckExplicit) with moveAckFloor.
func (s *mServer) ack(seq int64) {
	p, ok := s.pending[seq]
	if !ok {
		return
	}
	delete(s.pending, seq)
	s.acked[seq] = true
	if len(s.pending) == 0 {
		s.adflr = s.dseq - 1
		s.asflr = s.sseq - 1
	} else if p.odseq == s.adflr+1 {
		s.adflr, s.asflr = p.odseq, seq
		for ss := seq + 1; ss < s.sseq; ss++ {
			if q, ok := s.pending[ss]; ok {
				if q.odseq > 0 {
					s.adflr, s.asflr = q.odseq-1, ss-1
				}
				break
			}
		}
	}
	delete(s.rdc, seq)
	if i := slices.Index(s.rdq, seq); i >= 0 {
		s.rdq = slices.Delete(s.rdq, i, i+1)
	}
}

// nak is processNak: redeliver now.
func (s *mServer) nak(d mDelivery) {
	if d.dseq <= s.adflr || d.dseq > s.dseq {
		return
	}
	if _, ok := s.pending[d.seq]; !ok || s.inRdq(d.seq) {
		return
	}
	s.rdq = append(s.rdq, d.seq)
}

// expire is checkPending for one message: AckWait passed.
func (s *mServer) expire(seq int64) {
	if _, ok := s.pending[seq]; ok && !s.inRdq(seq) {
		s.rdq = append(s.rdq, seq)
	}
}

// info: ack floor (stream), delivered (stream), delivered (consumer).
func (s *mServer) info() (int64, int64, uint64) { return s.asflr, s.sseq - 1, s.dseq - 1 }

// undelivered reports whether a matching message was never delivered.
func (s *mServer) undelivered() bool {
	for seq := s.sseq; seq <= int64(len(s.match)); seq++ {
		if s.match[seq-1] {
			return true
		}
	}
	return false
}

// ---- bridge instance model ----

const mKey = "k"

type mStore struct {
	hasFloor bool
	floor    int64
	cps      map[string]shard.Checkpoint // held slots by key
	msgs     map[int64]int
}

func newStore() *mStore {
	return &mStore{cps: map[string]shard.Checkpoint{}, msgs: map[int64]int{}}
}

// slots is Source.loadHeld's read of the store.
func (s *mStore) slots() heldSlotState {
	var out heldSlotState
	for i := range out.span {
		if cp, ok := s.cps[HeldKey(mKey, i)]; ok {
			out.span[i], out.inc[i] = span{lo: int64(cp.Fingerprint), hi: cp.Offset}, cp.Incarnation
		}
	}
	return out
}

const (
	phIdle = iota
	phSeen
	phCommitted
)

type mInst struct {
	id    int
	up    bool
	st    *floorState
	store *mStore
	inbox []mDelivery

	phase int
	batch []mDelivery
	items []int64
	high  int64
	cp    int64
	spans []span
	slots heldSlotState
	hc    []shard.Checkpoint // the batch's held slot writes
	// overflows of the model before this batch's see
	overBefore int
}

type mAck struct {
	inst int
	seq  int64
}

type model struct {
	r      *rand.Rand
	srv    *mServer
	insts  []*mInst
	trace  []string
	failed string
	// delayed acks, sent but not yet processed by the server
	delayed []mAck
	// per sequence: what happened to it
	crashInFlight  map[int64]bool // unacked in an instance's hands at a crash or stop
	ackLost        map[int64]bool
	expired        map[int64]bool // AckWait expired (or nak) while not acked
	overflowed     bool           // spans needed more than heldSlots slots at some point
	overflows      int            // how many times
	overAt         map[int64]int  // overflows when the sequence was first stored
	heldBySpan     int            // sees held above the floor
	barrierBatches int
	storedBy       map[int64][]int
	dupReasons     map[string]int
	prof           profile
}

func (m *model) logf(format string, args ...any) {
	m.trace = append(m.trace, fmt.Sprintf(format, args...))
}

func (m *model) fail(format string, args ...any) {
	if m.failed == "" {
		m.failed = fmt.Sprintf(format, args...)
		m.logf("FAIL: %s", m.failed)
	}
}

func (m *model) storedAnywhere(seq int64) bool {
	for _, in := range m.insts {
		if in.store.msgs[seq] > 0 {
			return true
		}
	}
	return false
}

func (m *model) start(in *mInst) {
	af, del, dd := m.srv.info()
	in.st.start(af, del, dd)
	m.logf("  i%d start(ackFloor=%d, delivered=%d, dseq=%d) -> floor=%d barrier=%d spans=%v", in.id, af, del, dd, in.st.floor, in.st.barrier, in.st.spans)
	m.nakUnseen(in, dd)
}

// nakUnseen is Source.nakUnseen: a nak of each unseen sequence with the
// consumer sequence dseq, one in six lost. What it makes the server
// redeliver counts as expired (a redelivery, as after AckWait).
func (m *model) nakUnseen(in *mInst, dseq uint64) {
	u := in.st.takeUnseen()
	var sent []int64
	for _, sp := range u {
		for seq := sp.lo; seq <= sp.hi; seq++ {
			if m.r.IntN(6) == 0 {
				continue
			}
			if _, ok := m.srv.pending[seq]; ok {
				m.expired[seq] = true
			}
			m.srv.nak(mDelivery{seq: seq, dseq: dseq})
			sent = append(sent, seq)
		}
	}
	if len(u) > 0 {
		m.logf("  i%d unseen naks %v (dseq %d) sent %v", in.id, u, dseq, sent)
	}
}

// reset is consume's reset of the pulls (a reconnect, missed heartbeats):
// the buffer is kept (set aside), then resumed with the consumer info.
func (m *model) reset(in *mInst) {
	var ad uint64
	var as int64
	for _, d := range in.inbox {
		ad, as = max(ad, d.dseq), max(as, d.seq)
	}
	_, del, dd := m.srv.info()
	in.st.resumed(del, dd, ad, as)
	m.logf("i%d reset: resumed(delivered=%d, dseq=%d, aside %d/%d)", in.id, del, dd, ad, as)
	m.nakUnseen(in, dd)
}

// restart is Run from the top: a new floorState from the store.
func (m *model) restart(in *mInst) {
	in.up = true
	in.st = &floorState{}
	// storedFloor, then (Run, once the incarnation is settled)
	// keepIncarnation: one incarnation of the stream in this model.
	if in.store.hasFloor {
		in.st.floor = in.store.floor
		in.st.loadHeld(in.store.slots())
	}
	in.st.keepIncarnation(0)
	in.inbox, in.phase, in.batch = nil, phIdle, nil
	m.logf("i%d restart: stored floor=%d spans=%v", in.id, in.st.floor, in.st.spans)
	m.start(in)
}

func spansOver(spans, pend []span, floor int64) bool {
	all := append(slices.Clone(spans), pend...)
	all = slices.DeleteFunc(all, func(sp span) bool { return sp.hi <= floor })
	slices.SortFunc(all, func(a, b span) int { return int(a.lo - b.lo) })
	n := 0
	var last int64 = -10
	for _, sp := range all {
		if n > 0 && sp.lo <= last+1 {
			last = max(last, sp.hi)
			continue
		}
		n++
		last = sp.hi
	}
	return n > heldSlots
}

// see is the first half of process, up to the handler call.
func (m *model) see(in *mInst, n int) {
	in.batch = slices.Clone(in.inbox[:n])
	in.inbox = in.inbox[n:]
	in.items, in.high = nil, 0
	var desc []string
	for _, d := range in.batch {
		if d.dseq <= in.st.lastDseq {
			m.fail("i%d: delivery %d after %d (consumer sequence went back)", in.id, d.dseq, in.st.lastDseq)
			return
		}
		above := d.seq > in.st.floor
		held := in.st.see(d.dseq, d.seq, d.dc <= 1)
		if held && above {
			m.heldBySpan++
		}
		desc = append(desc, fmt.Sprintf("%d/d%d/n%d:%v", d.seq, d.dseq, d.dc, map[bool]string{true: "HELD", false: "new"}[held]))
		if held {
			if !m.storedAnywhere(d.seq) {
				m.fail("LOSS: i%d sees seq %d (dseq %d, n %d) as held, but no store holds it", in.id, d.seq, d.dseq, d.dc)
			}
			continue
		}
		in.items = append(in.items, d.seq)
		in.high = max(in.high, d.seq)
	}
	m.nakUnseen(in, in.st.lastDseq)
	slices.Sort(in.items)
	in.items = slices.Compact(in.items)
	in.overBefore = m.overflows
	if len(in.items) > 0 {
		if spansOver(in.st.spans, in.st.pend, in.st.checkpoint(in.high)) {
			m.overflowed = true
			m.overflows++
		}
		in.cp = in.st.checkpoint(in.high)
		if in.st.barrier != 0 {
			m.barrierBatches++
		}
		in.spans = in.st.nextSpans(in.cp)
		var cps []string
		hc, slots := in.st.heldCheckpoints(mKey, 0, in.spans)
		in.slots, in.hc = slots, hc
		for _, c := range hc {
			cps = append(cps, fmt.Sprintf("%s=[%d,%d]", strings.TrimPrefix(c.Key, mKey+"|held|"), c.Fingerprint, c.Offset))
		}
		in.phase = phSeen
		m.logf("i%d see %v -> items %v cp=%d barrier=%d spans=%v writes=%v", in.id, desc, in.items, in.cp, in.st.barrier, in.spans, cps)
	} else {
		if spansOver(in.st.spans, in.st.pend, in.st.floor) {
			m.overflowed = true
			m.overflows++
		}
		in.st.commitPend()
		in.phase = phCommitted
		m.logf("i%d see %v -> nothing to store; spans=%v", in.id, desc, in.st.spans)
	}
}

func (m *model) commit(in *mInst) {
	m.commitStoreOnly(in)
	in.st.handled(in.high, in.cp, in.spans, in.slots)
	in.phase = phCommitted
	m.logf("i%d commit items %v floor=%d slots=%v", in.id, in.items, in.cp, nonEmpty(in.store.slots()))
}

// commitStoreOnly makes the batch in hand durable in the store.
func (m *model) commitStoreOnly(in *mInst) {
	for _, c := range in.hc {
		in.store.cps[c.Key] = c
	}
	in.store.hasFloor = true
	in.store.floor = in.cp
	for _, seq := range in.items {
		if prev := m.storedBy[seq]; len(prev) > 0 {
			m.classifyDup(in, seq, prev)
		}
		if len(m.storedBy[seq]) == 0 {
			m.overAt[seq] = in.overBefore
		}
		in.store.msgs[seq]++
		m.storedBy[seq] = append(m.storedBy[seq], in.id)
	}
}

func nonEmpty(s heldSlotState) []span {
	var out []span
	for _, sp := range s.span {
		if sp != (span{}) {
			out = append(out, sp)
		}
	}
	return out
}

func (m *model) classifyDup(in *mInst, seq int64, prev []int) {
	var why string
	switch {
	case m.crashInFlight[seq]:
		why = "in flight at a crash/stop"
	case !slices.Contains(prev, in.id):
		why = "redelivered to the other instance (ack lost or AckWait passed)"
	case m.overflows > m.overAt[seq]:
		why = "same instance, spans overflowed"
	default:
		why = "same instance, no crash, no overflow"
	}
	m.dupReasons[why]++
	m.logf("  DUP seq %d stored again by i%d (before by %v): %s", seq, in.id, prev, why)
	if len(m.insts) == 1 && m.overflows == m.overAt[seq] {
		m.fail("DUPLICATE beyond the design: seq %d stored again by i%d (before by %v), no crash in flight, no span overflow", seq, in.id, prev)
	}
}

func (m *model) acks(in *mInst, faults bool) {
	var desc []string
	for _, d := range in.batch {
		x := 0
		if faults {
			x = m.r.IntN(10)
		}
		switch {
		case !faults || x < m.prof.ackOK:
			m.srv.ack(d.seq)
			desc = append(desc, fmt.Sprintf("%d:ok", d.seq))
		case x < m.prof.ackLost:
			m.ackLost[d.seq] = true
			desc = append(desc, fmt.Sprintf("%d:lost", d.seq))
		default:
			m.delayed = append(m.delayed, mAck{in.id, d.seq})
			desc = append(desc, fmt.Sprintf("%d:delayed", d.seq))
		}
	}
	m.logf("i%d acks %v -> server ackfloor=%d", in.id, desc, m.srv.asflr)
	in.batch, in.phase = nil, phIdle
	if in.st.barrier != 0 && (!faults || m.r.IntN(2) == 0) {
		af, del, _ := m.srv.info()
		in.st.ackFloor(af, del)
		m.logf("  i%d ackFloor(%d, %d) -> floor=%d barrier=%d spans=%v", in.id, af, del, in.st.floor, in.st.barrier, in.st.spans)
	}
}

// down: a crash (kill -9) or a stop (ctx ended: the batch in hand and the
// buffer are nakked, unless the nak is lost).
func (m *model) down(in *mInst, stop bool) {
	hands := append(slices.Clone(in.inbox), in.batch...)
	for _, d := range hands {
		if _, ok := m.srv.pending[d.seq]; ok {
			m.crashInFlight[d.seq] = true
		}
	}
	if stop && in.phase != phCommitted {
		for _, d := range hands {
			if m.r.IntN(4) != 0 {
				m.srv.nak(d)
			}
		}
	}
	what := map[bool]string{true: "stop", false: "CRASH"}[stop]
	m.logf("i%d %s in phase %d, in hand %v", in.id, what, in.phase, seqsOf(hands))
	in.up, in.inbox, in.batch, in.phase = false, nil, nil, phIdle
	// A stop with a committed batch acks it first (process completes).
}

func seqsOf(ds []mDelivery) []int64 {
	var out []int64
	for _, d := range ds {
		out = append(out, d.seq)
	}
	return out
}

// iterRestart: consume fails (no heartbeat, a reconnect): the buffer is
// nakked, and a new iterator starts from consumer info with the same
// floorState.
func (m *model) iterRestart(in *mInst) {
	for _, d := range in.inbox {
		if m.r.IntN(4) != 0 {
			m.srv.nak(d)
		}
	}
	m.logf("i%d iterator restart, buffer %v nakked", in.id, seqsOf(in.inbox))
	in.inbox = nil
	m.start(in)
}

// Event kinds, with per-seed random weights.
const (
	evPublish = iota
	evDeliver
	evSee
	evCommit
	evAcks
	evDelayedAck
	evExpire
	evCrash
	evStop
	evRestart
	evIterRestart
	evReset
	evKinds
)

type profile struct {
	w        [evKinds]int
	lossIn12 int // deliveries lost in transit, out of 12
	maxBatch int
	ackOK    int // of 10: applied at once; then lost, then delayed
	ackLost  int
}

func randomProfile(r *rand.Rand) profile {
	base := [evKinds]int{12, 28, 18, 10, 10, 4, 6, 3, 2, 4, 3, 3}
	var p profile
	for i, b := range base {
		p.w[i] = max(1, b*(1+r.IntN(4))/2)
	}
	p.lossIn12 = r.IntN(4)
	p.maxBatch = 1 + r.IntN(8)
	p.ackOK = 4 + r.IntN(6)
	p.ackLost = p.ackOK + r.IntN(11-p.ackOK)
	return p
}

func (m *model) pick() int {
	total := 0
	for _, w := range m.prof.w {
		total += w
	}
	x := m.r.IntN(total)
	for k, w := range m.prof.w {
		if x < w {
			return k
		}
		x -= w
	}
	return 0
}

func (m *model) step() {
	r := m.r
	switch m.pick() {
	case evPublish:
		match := r.IntN(8) != 0
		seq := m.srv.publish(match)
		m.logf("publish %d match=%v", seq, match)
	case evDeliver:
		d, ok := m.srv.next(r)
		if !ok {
			return
		}
		if r.IntN(12) < m.prof.lossIn12 {
			m.logf("deliver %d/d%d/n%d -> lost in transit", d.seq, d.dseq, d.dc)
			return
		}
		in := m.insts[r.IntN(len(m.insts))]
		if !in.up {
			m.logf("deliver %d/d%d/n%d -> i%d is down: lost", d.seq, d.dseq, d.dc, in.id)
			return
		}
		in.inbox = append(in.inbox, d)
		m.logf("deliver %d/d%d/n%d -> i%d", d.seq, d.dseq, d.dc, in.id)
	case evSee:
		in := m.insts[r.IntN(len(m.insts))]
		if in.up && in.phase == phIdle && len(in.inbox) > 0 {
			m.see(in, 1+r.IntN(min(len(in.inbox), m.prof.maxBatch)))
		}
	case evCommit:
		in := m.insts[r.IntN(len(m.insts))]
		if in.up && in.phase == phSeen {
			m.commit(in)
		}
	case evAcks:
		in := m.insts[r.IntN(len(m.insts))]
		if in.up && in.phase == phCommitted {
			m.acks(in, true)
		}
	case evDelayedAck:
		if len(m.delayed) > 0 {
			i := r.IntN(len(m.delayed))
			a := m.delayed[i]
			m.delayed = slices.Delete(m.delayed, i, i+1)
			if r.IntN(5) == 0 {
				m.ackLost[a.seq] = true
				m.logf("delayed ack %d of i%d lost", a.seq, a.inst)
			} else {
				m.srv.ack(a.seq)
				m.logf("delayed ack %d of i%d arrives -> ackfloor=%d", a.seq, a.inst, m.srv.asflr)
			}
		}
	case evExpire:
		var cand []int64
		for seq := range m.srv.pending {
			if !m.srv.inRdq(seq) {
				cand = append(cand, seq)
			}
		}
		if len(cand) > 0 {
			slices.Sort(cand)
			seq := cand[r.IntN(len(cand))]
			m.srv.expire(seq)
			m.expired[seq] = true
			m.logf("AckWait expires for %d", seq)
		}
	case evCrash:
		in := m.insts[r.IntN(len(m.insts))]
		if in.up {
			m.down(in, false)
		}
	case evStop:
		in := m.insts[r.IntN(len(m.insts))]
		if in.up {
			if in.phase == phCommitted {
				m.acks(in, true) // process completes before Run returns
			}
			if in.phase == phSeen && r.IntN(2) == 0 {
				// The ingest was durable, but Handle returned ctx's
				// error (waiting for the batch's dead letters): the
				// store holds the batch, the source abandons it.
				m.commitStoreOnly(in)
			}
			m.down(in, true) // a batch in the handler is abandoned and nakked
		}
	case evRestart:
		in := m.insts[r.IntN(len(m.insts))]
		if !in.up {
			m.restart(in)
		}
	case evReset:
		in := m.insts[r.IntN(len(m.insts))]
		if in.up && in.phase == phIdle {
			m.reset(in)
		}
	case evIterRestart:
		in := m.insts[r.IntN(len(m.insts))]
		if in.up && in.phase == phIdle {
			m.iterRestart(in)
		}
	}
}

// drain: no more faults; run everything to quiescence.
func (m *model) drain() {
	m.logf("--- drain ---")
	for _, a := range m.delayed {
		m.srv.ack(a.seq)
	}
	m.delayed = nil
	for _, in := range m.insts {
		if in.up && in.phase == phSeen {
			m.commit(in)
		}
		if in.up && in.phase == phCommitted {
			m.acks(in, false)
		}
		if !in.up {
			m.restart(in)
		}
	}
	for round := 0; ; round++ {
		if round > 10000 {
			m.fail("STALL: no quiescence; pending %v rdq %v", m.srv.pending, m.srv.rdq)
			return
		}
		progress := false
		for i := 0; ; i++ {
			d, ok := m.srv.next(m.r)
			if !ok {
				break
			}
			in := m.insts[i%len(m.insts)]
			in.inbox = append(in.inbox, d)
			progress = true
		}
		for _, in := range m.insts {
			for len(in.inbox) > 0 && m.failed == "" {
				m.see(in, min(len(in.inbox), 4))
				if in.phase == phSeen {
					m.commit(in)
				}
				m.acks(in, false)
				progress = true
			}
		}
		if m.failed != "" {
			return
		}
		if len(m.srv.pending) == 0 && !m.srv.undelivered() {
			break
		}
		if !progress {
			for _, seq := range slices.Sorted(maps.Keys(m.srv.pending)) {
				m.srv.expire(seq)
			}
		}
	}
	for seq := int64(1); seq <= int64(len(m.srv.match)); seq++ {
		if m.srv.match[seq-1] && !m.storedAnywhere(seq) {
			m.fail("LOSS: seq %d acked=%v, never stored", seq, m.srv.acked[seq])
		}
	}
}

type modelStats struct {
	events, dups, overflows, heldBySpan, barrierBatches int
	reasons                                             map[string]int
}

func runModel(seed uint64, ninst, nevents int, stats *modelStats) *model {
	m := &model{
		r: rand.New(rand.NewPCG(seed, 0x5eed)), srv: newServer(),
		crashInFlight: map[int64]bool{}, ackLost: map[int64]bool{}, expired: map[int64]bool{},
		storedBy: map[int64][]int{}, overAt: map[int64]int{}, dupReasons: map[string]int{},
	}
	m.prof = randomProfile(m.r)
	for i := range ninst {
		in := &mInst{id: i, store: newStore()}
		m.insts = append(m.insts, in)
		m.restart(in)
	}
	for range nevents {
		m.step()
		if m.failed != "" {
			return m
		}
	}
	m.drain()
	if stats != nil {
		stats.events += nevents
		for k, v := range m.dupReasons {
			stats.reasons[k] += v
			stats.dups += v
		}
		if m.overflowed {
			stats.overflows++
		}
		stats.heldBySpan += m.heldBySpan
		stats.barrierBatches += m.barrierBatches
	}
	return m
}

var modelDump = flag.Int64("floormodel.dump", -1, "print the trace of this seed (with -floormodel.maxinst instances)")

func TestFloorModelDump(t *testing.T) {
	if *modelDump < 0 {
		t.Skip("no seed")
	}
	m := runModel(uint64(*modelDump), *modelMaxInst, *modelEvents, nil)
	t.Logf("failed: %q\n%s", m.failed, strings.Join(m.trace, "\n"))
}

func TestFloorModel(t *testing.T) {
	for ninst := 1; ninst <= *modelMaxInst; ninst++ {
		stats := &modelStats{reasons: map[string]int{}}
		seeds := *modelSeeds
		if os.Getenv("DELAYBRIDGE_LONG") != "" && seeds == 4000 {
			seeds = 100_000 // make test-long
		}
		for seed := range uint64(seeds) {
			m := runModel(seed, ninst, *modelEvents, stats)
			if m.failed != "" {
				t.Fatalf("instances %d seed %d: %s\ntrace:\n%s", ninst, seed, m.failed, strings.Join(m.trace, "\n"))
			}
		}
		t.Logf("instances %d: %d seeds, %d events, %d duplicates %v, seeds with span overflow %d, held by a span %d, batches under a barrier %d",
			ninst, seeds, stats.events, stats.dups, stats.reasons, stats.overflows, stats.heldBySpan, stats.barrierBatches)
	}
}
