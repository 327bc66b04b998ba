package service

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// TestKafkaOrderModel drives random histories of schedules, replaces and
// cancels of a small id space through the Kafka delay topic's three
// partitions, as clients that partition differently and whose clocks
// disagree would publish them, across graceful restarts of the bridge, and
// checks every id's deliveries against an independent model of CONTRACT
// §1 and the headers of every delivery against §2.
//
// The model. Ids are scoped to the topic; between two messages of an id
// the later broker timestamp wins, on one partition the later offset; a
// tie across partitions keeps what is held (docs/design.md, "Replace and
// cancel"); a cancel (delay-cancel: true, or a tombstone keyed by the id)
// is remembered, so an older schedule read after it is dropped; a task
// that fired is forgotten (its index entry goes with it), so a message of
// its id read later starts afresh. Which of two messages on different
// partitions the bridge reads first is not fixed, and that order decides
// when the rules above disagree with each other (a skewed client's older
// timestamp behind a newer one on its partition, equal timestamps), so
// the model enumerates every interleaving of the partitions' messages
// between two ingest barriers (the test waits until the bridge committed
// everything published) and accepts any outcome one of them yields. A
// schedule due in the past fires at once if it wins: the model lets it
// fire (and be forgotten) before any later message of its id is read, or
// be superseded while in flight (delivered or not). Everything else is due
// in the future of the injected clock, which stands still until a round's
// messages are all ingested; then it moves past every due and the test
// waits until everything the bridge delivered has been read back.
//
// The outcome of a round for an id is the set of its values delivered;
// it must be one the model allows, and the ids' states (nothing held, or a
// cancel remembered) that the matching interleavings leave carry into the
// next round, so cancels of one round drop older schedules of the next.
// Keyless schedules (id = origin) must arrive; a bad due with an id goes
// to the DLQ, unchanged, and leaves the id alone.
//
// The history: each round talks of two to five of the five ids, so the
// others keep a pending task or a cancel into later rounds; a sixth of the
// schedules are due in the past, a sixth beyond the round and the
// horizon; timestamps are mostly later than the id's last, sometimes
// equal, older, far older (by more than cancel_retention, which is 15 to
// 60 s by seed), ahead of the bridge's clock, or just below the id's last
// cancel; a fifth of the rounds are published while the bridge is down;
// it is stopped and started between messages, and in a quarter of the
// rounds while tasks come due.
//
// The seed is logged; DELAYBRIDGE_MODEL_SEED=N replays its history (the
// messages depend on the seed alone). The short form runs 12 rounds of 16
// messages (about 2 s); DELAYBRIDGE_LONG=1 runs 60 of 30 (about 16 s).
func TestKafkaOrderModel(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("DELAYBRIDGE_MODEL_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("DELAYBRIDGE_MODEL_SEED: %v", err)
		}
		seed = n
	}
	rounds, opsPerRound := 12, 16
	if os.Getenv("DELAYBRIDGE_LONG") != "" {
		rounds, opsPerRound = 60, 30
	}
	t.Logf("seed %d (replay: DELAYBRIDGE_MODEL_SEED=%d)", seed, seed)
	m := newOrderModel(t, seed)
	for r := range rounds {
		m.round(r, opsPerRound, false)
	}
	m.round(rounds, 0, true) // the long dues
	t.Logf("seed %d: %d rounds, %d messages, %d deliveries checked, %d duplicates, %d restarts, %d ambiguous id-rounds (more than one outcome allowed), %d id-rounds decided by cancel_retention (%d ms)",
		seed, rounds, m.nmsgs, m.checked, m.dups, m.restarts, m.ambiguous, m.expired, m.retention)
	if t.Failed() {
		t.Logf("replay: DELAYBRIDGE_MODEL_SEED=%d", seed)
	}
}

const (
	moParts = 3 // partitions of the delay topic (newEnv)
	moIDs   = 5 // the id space
)

type moKind int

const (
	moSchedule  moKind = iota
	moCancel           // delay-cancel: true
	moTombstone        // null value, key = id
	moAnon             // a schedule without key or delay-id: its id is its origin
	moBad              // a bad due with a delay-id: a dead letter
)

func (k moKind) String() string {
	return [...]string{"schedule", "cancel", "tombstone", "anon", "bad"}[k]
}

// moOrder is the replace/cancel stamp of a message, as CONTRACT §1 orders
// them.
type moOrder struct {
	stamp int64
	part  int32
	off   int64
}

func (o moOrder) newerThan(old moOrder) bool {
	if o.part == old.part {
		return o.off > old.off
	}
	return o.stamp > old.stamp
}

// moMsg is one message published to the delay topic.
type moMsg struct {
	n       int
	round   int
	kind    moKind
	id      string // the task id it names ("" for moAnon: the origin)
	key     string // the Kafka key ("" none)
	idHdr   bool   // id sent as delay-id
	ord     moOrder
	value   string
	due     int64
	pastDue bool // due at or before the bridge's clock when published
	long    bool // due after the round's end: pending into later rounds
	dkey    string
	srcHdrs []codec.Header // the non-control headers, in order
	seg     int            // ingest barrier segment within the round
	origin  string
}

func (m *moMsg) String() string {
	s := fmt.Sprintf("#%d %s id=%q key=%q p%d@%d ts=%d seg=%d", m.n, m.kind, m.id, m.key, m.ord.part, m.ord.off, m.ord.stamp, m.seg)
	if m.kind == moSchedule || m.kind == moAnon {
		s += fmt.Sprintf(" value=%s due=%d", m.value, m.due)
		if m.pastDue {
			s += " (past)"
		}
	}
	return s
}

// moState is what the store holds for an id.
type moState struct {
	kind   int // 0 nothing, 1 a pending task, 2 a cancel marker
	ord    moOrder
	value  string // of the pending task
	due    int64  // of the pending task
	firing bool   // the pending task is due: the fire loop may take it any time
	expiry int64  // of the cancel marker: forgotten from then on
}

const (
	moNothing = iota
	moPending
	moMarker
)

func (s moState) String() string {
	switch s.kind {
	case moPending:
		return fmt.Sprintf("pending(%s p%d@%d ts=%d due=%d firing=%v)", s.value, s.ord.part, s.ord.off, s.ord.stamp, s.due, s.firing)
	case moMarker:
		return fmt.Sprintf("cancelled(p%d@%d ts=%d until %d)", s.ord.part, s.ord.off, s.ord.stamp, s.expiry)
	}
	return "nothing"
}

type orderModel struct {
	t       *testing.T
	e       *env
	rng     *rand.Rand
	svc     *Service
	stop    func()
	down    bool
	nextOff [moParts]int64
	stamp   map[string]int64 // per id: the last timestamp its publishers used
	// stale holds, for some of the ids whose last message was a cancel,
	// that cancel's timestamp; lastCancel all of them.
	stale, lastCancel map[string]int64
	states            map[string][]moState // per id: the states the history so far allows
	msgs              []*moMsg             // every message, in publish order
	byValue           map[string]*moMsg
	read              int             // deliveries checked so far
	delivered         map[string]bool // values delivered so far
	retention         int64           // cancel_retention, ms
	nmsgs             int
	checked           int
	dups              int
	restarts          int
	// ambiguous counts id-rounds whose interleavings allowed more than
	// one outcome.
	ambiguous int
	// expired counts id-rounds whose outcomes a cancel's expiry changed.
	expired int
}

func newOrderModel(t *testing.T, seed uint64) *orderModel {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	// A round moves the clock 6 to 71 s: a cancel is forgotten after
	// the next round, or after a few.
	secs := 15 + rng.IntN(45)
	m := &orderModel{t: t, e: newEnv(t, fmt.Sprintf("cancel_retention: %ds\n", secs)), retention: int64(secs) * 1000,
		delivered: map[string]bool{}, rng: rng, stamp: map[string]int64{}, stale: map[string]int64{}, lastCancel: map[string]int64{}, states: map[string][]moState{}, byValue: map[string]*moMsg{}}
	for i := range moIDs {
		id := "id" + strconv.Itoa(i)
		m.states[id] = []moState{{}}
		m.stamp[id] = m.now()
	}
	m.svc, m.stop = m.e.start()
	return m
}

func (m *orderModel) now() int64 { return m.e.clk.Now().UnixMilli() }

// nextStamp is an id's next record timestamp: mostly later than its last
// one, sometimes equal, sometimes older (a client whose clock is behind,
// sometimes by more than a round), sometimes well ahead of the bridge's
// clock.
func (m *orderModel) nextStamp(id string) int64 {
	last := m.stamp[id]
	var ts int64
	switch r := m.rng.IntN(100); {
	case r < 20:
		ts = last
	case r < 25:
		// A client whose clock is ahead of the bridge's.
		ts = max(last, m.now()) + 10_000 + int64(m.rng.IntN(50_000))
	case r < 32:
		// Far behind: older than what an earlier round's cancel left,
		// which is remembered for cancel_retention only.
		ts = last - 10_000 - int64(m.rng.IntN(60_000))
	case r < 47:
		ts = last - 1 - int64(m.rng.IntN(3000))
	default:
		ts = last + 1 + int64(m.rng.IntN(3000))
	}
	m.stamp[id] = max(last, ts)
	return ts
}

func (m *orderModel) produce(msg *moMsg, hs []codec.Header, value []byte) {
	m.t.Helper()
	r := &kgo.Record{Topic: kafkaDelay, Partition: msg.ord.part, Value: value, Timestamp: time.UnixMilli(msg.ord.stamp)}
	if msg.key != "" {
		r.Key = []byte(msg.key)
	}
	for _, h := range hs {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: h.Key, Value: h.Value})
	}
	res, err := m.e.kcl.ProduceSync(context.Background(), r).First()
	if err != nil {
		m.t.Fatalf("produce: %v", err)
	}
	if res.Offset != m.nextOff[msg.ord.part] {
		m.t.Fatalf("produced at offset %d of partition %d, want %d", res.Offset, msg.ord.part, m.nextOff[msg.ord.part])
	}
	m.nextOff[msg.ord.part]++
	msg.ord.off = res.Offset
	msg.origin = fmt.Sprintf("kafka:delay/%d@%d", msg.ord.part, res.Offset)
	m.nmsgs++
	m.msgs = append(m.msgs, msg)
	if msg.value != "" {
		m.byValue[msg.value] = msg
	}
}

// ctl is a control header with its name in a random case (§1: matched
// case-insensitively).
func (m *orderModel) ctl(name, value string) codec.Header {
	return codec.Header{Key: randCase(m.rng, name), Value: []byte(value)}
}

// idHeaders picks how msg names its id: by its key (the default id, also
// with an empty delay-id), by delay-id with the same key, or by delay-id with the key of another id of
// the space or none (so a key alone would name the wrong task).
func (m *orderModel) idHeaders(msg *moMsg) []codec.Header {
	switch r := m.rng.IntN(4); {
	case r == 0 || msg.kind == moTombstone:
		msg.key = msg.id
		return nil
	case r == 3:
		// An empty delay-id names nothing: the key is the id.
		msg.key = msg.id
		return []codec.Header{m.ctl("delay-id", "")}
	case r == 1:
		msg.key, msg.idHdr = msg.id, true
	default:
		msg.idHdr = true
		if other := "id" + strconv.Itoa(m.rng.IntN(moIDs)); other != msg.id && m.rng.IntN(3) > 0 {
			msg.key = other
		} else if m.rng.IntN(2) == 0 {
			msg.key = "k" + strconv.Itoa(msg.n)
		}
	}
	return []codec.Header{m.ctl("delay-id", msg.id)}
}

// dueHeader sets msg's due time: a sixth of them in the past, a sixth 60
// to 180 s ahead of the (standing) clock, beyond the round's end and the
// bridge's horizon (1 min: stored, not in a wheel, until the loader
// reaches them), the rest 5 to 30 s ahead; as delay-at (RFC 3339 or epoch
// ms) or as delay-after from the message's own timestamp.
func (m *orderModel) dueHeader(msg *moMsg) codec.Header {
	now := m.now()
	switch r := m.rng.IntN(6); {
	case r == 0:
		msg.due = now - int64(m.rng.IntN(5000))
		msg.pastDue = true
	case r == 1:
		msg.due = now + 60_000 + int64(m.rng.IntN(120_000))
		msg.long = true
	default:
		msg.due = now + 5000 + int64(m.rng.IntN(25_000))
	}
	after := msg.due - msg.ord.stamp
	switch r := m.rng.IntN(4); {
	case r == 0 && after >= 0:
		return m.ctl("delay-after", strconv.FormatInt(after, 10))
	case r == 1 && after >= 0:
		return m.ctl("delay-after", (time.Duration(after) * time.Millisecond).String())
	case r == 2:
		return m.ctl("delay-at", strconv.FormatInt(msg.due, 10))
	}
	return m.ctl("delay-at", codec.FormatDue(msg.due))
}

func (m *orderModel) randomKind() moKind {
	switch r := m.rng.IntN(100); {
	case r < 50:
		return moSchedule
	case r < 67:
		return moCancel
	case r < 84:
		return moTombstone
	case r < 92:
		return moAnon
	}
	return moBad
}

// publish makes and publishes one message of the round.
func (m *orderModel) publish(round, seg int, id string, kind moKind) *moMsg {
	n := len(m.msgs) + 1
	msg := &moMsg{n: n, round: round, seg: seg, kind: kind, ord: moOrder{part: int32(m.rng.IntN(moParts))}}
	if msg.kind == moAnon {
		msg.ord.stamp = m.now() - int64(m.rng.IntN(3000))
	} else {
		msg.id = id
		msg.ord.stamp = m.nextStamp(id)
		if c, ok := m.stale[id]; ok && msg.kind == moSchedule {
			// A schedule published before the cancel the store holds
			// for the id, read after it: dropped while the cancel is
			// remembered, scheduled once it is forgotten.
			msg.ord.stamp = c - int64(m.rng.IntN(2000))
			delete(m.stale, id)
		}
		switch msg.kind {
		case moCancel, moTombstone:
			m.lastCancel[id] = msg.ord.stamp
		case moSchedule:
			delete(m.lastCancel, id)
		}
	}
	var src, ctl []codec.Header
	if m.rng.IntN(2) == 0 {
		src = append(src, codec.Header{Key: "x-n", Value: []byte(strconv.Itoa(n))})
	}
	if m.rng.IntN(3) == 0 {
		src = append(src, codec.Header{Key: "x-multi", Value: []byte("a")}, codec.Header{Key: "x-multi", Value: []byte("b")})
	}
	var value []byte
	switch msg.kind {
	case moSchedule, moAnon:
		msg.value = fmt.Sprintf("r%dv%d", round, n)
		value = []byte(msg.value)
		if msg.kind == moSchedule {
			ctl = m.idHeaders(msg)
		}
		ctl = append(ctl, m.dueHeader(msg), m.ctl("delay-target", kafkaOut))
		if m.rng.IntN(4) == 0 {
			msg.dkey = "dk" + strconv.Itoa(n)
			ctl = append(ctl, m.ctl("delay-key", msg.dkey))
		}
		msg.srcHdrs = src
	case moCancel:
		ctl = append(m.idHeaders(msg), m.ctl("delay-cancel", "true"))
		if m.rng.IntN(2) == 0 {
			// A cancel's payload and other control headers are ignored.
			ctl = append(ctl, m.ctl("delay-target", kafkaOut), m.ctl("delay-after", "1s"))
		}
		value = []byte("ignored")
	case moTombstone:
		m.idHeaders(msg)
		src = nil
	case moBad:
		msg.value = fmt.Sprintf("r%dbad%d", round, n)
		value = []byte(msg.value)
		msg.key = msg.id
		ctl = []codec.Header{m.ctl("delay-id", msg.id), m.ctl("delay-after", "soon"), m.ctl("delay-target", kafkaOut)}
		msg.idHdr = true
	}
	m.produce(msg, interleave(m.rng, src, ctl), value)
	return msg
}

// barrier waits until the bridge committed every message published.
func (m *orderModel) barrier() {
	m.t.Helper()
	if m.down {
		m.startBridge()
	}
	eventually(m.t, "the bridge to commit every published message", func() bool {
		for p := range int32(moParts) {
			if m.nextOff[p] > 0 && m.e.committedOffset(p) < m.nextOff[p] {
				return false
			}
		}
		return true
	})
}

func (m *orderModel) startBridge() {
	m.svc, m.stop = m.e.start()
	m.down = false
}

// round publishes ops random messages, with ingest barriers and bridge
// restarts between some of them, then moves the clock past every due of
// the round (with drain: every due of the history), waits for what the
// bridge delivers and checks it against the model.
func (m *orderModel) round(r, ops int, drain bool) {
	t := m.t
	t.Helper()
	seg := 0
	first := len(m.msgs)
	// Each round talks of two to five of the ids: the others keep what
	// the store holds for them (a pending task, a cancel remembered) into
	// later rounds.
	var active []string
	for _, i := range m.rng.Perm(moIDs)[:2+m.rng.IntN(moIDs-1)] {
		active = append(active, "id"+strconv.Itoa(i))
	}
	clear(m.stale)
	var staleOnly []string
	for i := 0; i < len(active); i++ {
		id := active[i]
		// The history depends on the seed alone, not on what the bridge
		// did: a replay publishes the same messages.
		if c, ok := m.lastCancel[id]; ok && m.rng.IntN(2) == 0 {
			m.stale[id] = c
			if len(active) > 1 && m.rng.IntN(2) == 0 {
				// Nothing else of the id this round: whether the cancel
				// is still remembered decides its outcome.
				staleOnly = append(staleOnly, id)
				active = slices.Delete(active, i, i+1)
				i--
			}
		}
	}
	burst := ops > 0 && m.rng.IntN(5) == 0
	if burst && !m.down {
		// The whole round is published while the bridge is down: the
		// next one reads it in large batches, many messages of an id in
		// one.
		m.stop()
		m.down = true
		m.restarts++
	}
	for _, id := range staleOnly {
		if ops > 0 {
			m.publish(r, seg, id, moSchedule)
		}
	}
	for range ops {
		m.publish(r, seg, active[m.rng.IntN(len(active))], m.randomKind())
		if burst {
			continue
		}
		switch x := m.rng.IntN(100); {
		case x < 20:
			m.barrier()
			seg++
		case x < 24 && !m.down:
			// Graceful stop; the bridge stays down for the next messages
			// until a barrier or the next restart point starts it.
			m.stop()
			m.down = true
			m.restarts++
		case x < 30 && m.down:
			m.startBridge()
		}
	}
	m.barrier()
	msgs := m.msgs[first:]
	now := m.now()

	// The clock has not moved: a delivery of a value due in the future
	// fired early.
	for _, d := range m.e.deliveries() {
		if msg := m.byValue[d.value]; msg != nil && msg.kind != moBad && msg.due > now {
			t.Errorf("round %d: %s delivered before the clock (%d) reached its due", r, msg, now)
		}
	}
	// Past the round's dues (but not the long ones); then wait until every
	// task due went out and every record the bridge wrote was read back.
	end := now
	for _, msg := range m.msgs {
		if (msg.round == r && !msg.long) || drain {
			end = max(end, msg.due+1000)
		}
	}
	if m.rng.IntN(2) == 0 {
		end += int64(m.rng.IntN(40_000)) // idle time: cancels are forgotten
	}
	end = passDues(t, m.e, m.rng, func() *Service { return m.svc }, func() {
		m.stop()
		m.restarts++
		m.startBridge()
	}, kafkaDelay, now, end)
	m.readAll()
	m.check(r, msgs, now, end)
}

// passDues moves the clock from now to end, in a quarter of the rounds
// with a restart of the bridge halfway (restart; the next bridge finds the
// tasks that came due meanwhile overdue in its store), and waits until
// source holds no task due by the clock then, which it returns. svc is
// the running bridge's service (a restart replaces it).
func passDues(t *testing.T, e *env, rng *rand.Rand, svc func() *Service, restart func(), source string, now, end int64) int64 {
	t.Helper()
	if d := time.Duration(end-now) * time.Millisecond; d > 0 && rng.IntN(4) == 0 {
		e.advance(svc(), d/2, 2*time.Second)
		restart()
		e.advance(svc(), d-d/2, 2*time.Second)
	} else if d > 0 {
		e.advance(svc(), d, 2*time.Second)
	}
	end = e.clk.Now().UnixMilli()
	waitNoneDue(t, svc(), source, end)
	return end
}

// waitNoneDue waits until source holds no task due at or before end: a
// task leaves the store once its target acknowledged it (§4), so every
// one due by then was delivered (or dead-lettered).
func waitNoneDue(t *testing.T, svc *Service, source string, end int64) {
	t.Helper()
	eventually(t, "every task due delivered", func() bool {
		l, err := svc.Engine().ListTasks(source, shard.ListQuery{Limit: shard.MaxListLimit})
		if err != nil || l.Next != "" {
			return false
		}
		for _, ti := range l.Tasks {
			if ti.Due.UnixMilli() <= end {
				return false
			}
		}
		return true
	})
}

// readAll waits until the test's consumer has read as many records from
// the target and the DLQ as the broker holds.
func (m *orderModel) readAll() {
	m.t.Helper()
	eventually(m.t, "every delivered record read back", func() bool {
		n, err := m.endOffsets(kafkaOut, kafkaDLQ)
		return err == nil && int64(len(m.e.deliveries())) == n
	})
}

// endOffsets sums the high watermarks of topics' partitions.
func (m *orderModel) endOffsets(topics ...string) (int64, error) {
	req := kmsg.NewPtrListOffsetsRequest()
	for _, topic := range topics {
		rt := kmsg.NewListOffsetsRequestTopic()
		rt.Topic = topic
		for p := range int32(3) {
			rp := kmsg.NewListOffsetsRequestTopicPartition()
			rp.Partition, rp.Timestamp = p, -1
			rt.Partitions = append(rt.Partitions, rp)
		}
		req.Topics = append(req.Topics, rt)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := req.RequestWith(ctx, m.e.kcl)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, rt := range resp.Topics {
		for _, rp := range rt.Partitions {
			if rp.ErrorCode != 0 {
				return 0, fmt.Errorf("list offsets %s/%d: error %d", rt.Topic, rp.Partition, rp.ErrorCode)
			}
			n += rp.Offset
		}
	}
	return n, nil
}

// check compares the deliveries read since the last check (the round's)
// with the model: the round's messages were ingested at the clock's now,
// and the clock then moved to end.
func (m *orderModel) check(r int, msgs []*moMsg, now, end int64) {
	t := m.t
	all := m.e.deliveries()
	fresh := all[m.read:]
	m.read = len(all)
	got := map[string]bool{} // values first delivered in this round
	for _, d := range fresh {
		msg := m.byValue[d.value]
		if msg == nil {
			t.Errorf("round %d: unexpected delivery %q to %s", r, d.value, d.dest)
			continue
		}
		m.checkDelivery(msg, d)
		if m.delivered[d.value] || got[d.value] {
			m.dups++
			t.Logf("round %d: %s delivered again", r, msg)
			continue
		}
		got[d.value] = true
	}
	for v := range got {
		m.delivered[v] = true
	}
	for _, msg := range m.msgs {
		if (msg.kind == moAnon || msg.kind == moBad) && msg.due <= end && !m.delivered[msg.value] {
			t.Errorf("round %d: %s never delivered", r, msg)
			m.delivered[msg.value] = true // reported once
		}
	}
	for i := range moIDs {
		id := "id" + strconv.Itoa(i)
		var mine []*moMsg
		for _, msg := range msgs {
			if msg.id == id && msg.kind != moBad {
				mine = append(mine, msg)
			}
		}
		var seen []string
		for v := range got {
			if msg := m.byValue[v]; msg.id == id && msg.kind != moBad {
				seen = append(seen, v)
			}
		}
		sort.Strings(seen)
		observed := strings.Join(seen, ",")
		next, allowed, ok, expired := moJudge(m.states[id], mine, observed, now, end, m.retention)
		if len(allowed) > 1 {
			m.ambiguous++
		}
		if expired {
			m.expired++
		}
		if !ok {
			t.Errorf("round %d, %s: delivered {%s}; the model allows only %v", r, id, observed, allowed)
			t.Logf("  clock %d while ingesting, then %d; states at the round's start: %v", now, end, m.states[id])
			for _, msg := range mine {
				t.Logf("  %s", msg)
			}
		}
		m.states[id] = next
		m.checkStored(r, id)
	}
}

// checkStored compares what the store holds for id (the admin API's
// lookup) with the model, where the model allows one pending task or none.
func (m *orderModel) checkStored(r int, id string) {
	sts := m.states[id]
	if len(sts) == 0 {
		return
	}
	pending := sts[0].kind == moPending
	for _, st := range sts[1:] {
		if (st.kind == moPending) != pending || pending && st.value != sts[0].value {
			return // the model allows more than one
		}
	}
	ti, err := m.svc.Engine().Lookup(kafkaDelay, id)
	switch {
	case !pending && !errors.Is(err, shard.ErrNotFound):
		m.t.Errorf("round %d, %s: the store holds %+v (err %v); the model holds %v", r, id, ti, err, sts)
	case pending && err != nil:
		m.t.Errorf("round %d, %s: lookup: %v; the model holds %v", r, id, err, sts)
	case pending:
		msg := m.byValue[sts[0].value]
		if ti.Origin != msg.origin || ti.Due.UnixMilli() != msg.due || ti.Target != "kafka:"+kafkaOut {
			m.t.Errorf("round %d, %s: the store holds %+v; the model holds %s", r, id, ti, msg)
		}
	}
}

// checkDelivery checks one delivery against CONTRACT §2 (a schedule) or §3
// (a bad message).
func (m *orderModel) checkDelivery(msg *moMsg, d delivery) {
	t := m.t
	m.checked++
	var gotH []string
	for _, h := range d.headers {
		gotH = append(gotH, h.Key+"="+string(h.Value))
	}
	if msg.kind == moBad {
		if d.dest != kafkaDLQ || d.header(codec.HeaderError) != string(codec.CodeBadDue) || d.header(codec.HeaderOrigin) != msg.origin ||
			d.header(codec.HeaderErrorDetail) == "" || d.key != msg.key || !slices.ContainsFunc(d.headers, func(h codec.Header) bool {
			// Unchanged: its control headers too.
			return strings.EqualFold(h.Key, "delay-after") && string(h.Value) == "soon"
		}) {
			t.Errorf("%s: dead letter to %s key %q headers %v", msg, d.dest, d.key, gotH)
		}
		return
	}
	if d.transport != "kafka" || d.dest != kafkaOut {
		t.Errorf("%s delivered to %s:%s (error %q)", msg, d.transport, d.dest, d.header(codec.HeaderError))
		return
	}
	wantKey := msg.key
	if msg.dkey != "" {
		wantKey = msg.dkey
	}
	if d.key != wantKey {
		t.Errorf("%s delivered with key %q, want %q", msg, d.key, wantKey)
	}
	if d.at.UnixMilli() < msg.due {
		t.Errorf("%s delivered at %v, before its due %v", msg, d.at, time.UnixMilli(msg.due))
	}
	var want []string
	for _, h := range msg.srcHdrs {
		want = append(want, h.Key+"="+string(h.Value))
	}
	id := msg.id
	if msg.kind == moAnon {
		id = msg.origin
		if g := d.header(codec.HeaderID); strings.HasPrefix(g, msg.origin+"~i") {
			id = g // a re-created topic's origin id carries its incarnation
		}
	}
	want = append(want, "delay-id="+id, "delay-origin="+msg.origin, "delay-due="+codec.FormatDue(msg.due))
	if strings.Join(gotH, ",") != strings.Join(want, ",") {
		t.Errorf("%s delivered with headers\n got  %v\n want %v", msg, gotH, want)
	}
}

// moJudge judges an id-round: from any of states, the id's messages mine
// read at the clock's now, the clock then moved to end, delivered the
// values observed (sorted, comma-separated). It returns the states that
// outcome may leave (ok false: the model does not allow it, and next is
// every state the model allows, to go on from), the outcomes allowed (as
// "{v1,v2}", sorted) and whether cancel_retention changed them (with
// cancels never forgotten they would differ).
func moJudge(states []moState, mine []*moMsg, observed string, now, end, retention int64) (next []moState, allowed []string, ok, expired bool) {
	outcomes := map[moOutcome]bool{}
	for _, st := range states {
		for o := range moEnumerate(st, mine, now, end, retention) {
			outcomes[o] = true
		}
	}
	forever := map[string]bool{} // the outcomes were cancels never forgotten
	for _, st := range states {
		if st.kind == moMarker {
			st.expiry = math.MaxInt64
		}
		for o := range moEnumerate(st, mine, now, end, math.MaxInt64/2) {
			forever[o.delivered] = true
		}
	}
	dls := map[string]bool{}
	for o := range outcomes {
		dls[o.delivered] = true
		if o.delivered == observed && !slices.Contains(next, o.end) {
			next = append(next, o.end)
		}
	}
	for d := range dls {
		allowed = append(allowed, "{"+d+"}")
	}
	sort.Strings(allowed)
	ok = len(next) > 0
	if !ok {
		// Go on from every state the model allows.
		for o := range outcomes {
			if !slices.Contains(next, o.end) {
				next = append(next, o.end)
			}
		}
	}
	return next, allowed, ok, !maps.Equal(dls, forever)
}

// moOutcome is what one interleaving of a round does to an id: the values
// delivered (sorted, comma-separated) and the state left.
type moOutcome struct {
	delivered string
	end       moState
}

// moEnumerate returns every outcome of the id's messages msgs (in publish
// order) from state st, over every order the bridge may read them in: a
// segment's messages before the next segment's, a partition's in offset
// order, the partitions of a segment interleaved in any way. The messages
// are read at the clock's now (a cancel is remembered until now +
// retention), which then moves to end: what is pending and due by then
// fires.
func moEnumerate(st moState, msgs []*moMsg, now, end, retention int64) map[moOutcome]bool {
	var segs [][moParts][]*moMsg
	for _, msg := range msgs {
		for len(segs) <= msg.seg {
			segs = append(segs, [moParts][]*moMsg{})
		}
		segs[msg.seg][msg.ord.part] = append(segs[msg.seg][msg.ord.part], msg)
	}
	out := map[moOutcome]bool{}
	type node struct {
		seg int
		ptr [moParts]int
		st  moState
		dl  string
	}
	seen := map[node]bool{}
	var walk func(n node)
	walk = func(n node) {
		if seen[n] {
			return
		}
		seen[n] = true
		if n.st.kind == moPending && n.st.firing {
			// The fire loop takes it and the delete is durable before
			// the next message of the id is read.
			walk(node{n.seg, n.ptr, moState{}, moAddValue(n.dl, n.st.value)})
		}
		if n.seg == len(segs) {
			// The clock moves to end: what is pending and due fires.
			if n.st.kind == moPending && n.st.due <= end {
				n.dl, n.st = moAddValue(n.dl, n.st.value), moState{}
			}
			out[moOutcome{n.dl, n.st}] = true
			return
		}
		moved := false
		for p := range moParts {
			if n.ptr[p] >= len(segs[n.seg][p]) {
				continue
			}
			moved = true
			msg := segs[n.seg][p][n.ptr[p]]
			next := n
			next.ptr[p]++
			for _, s := range moApply(n.st, msg, now, retention) {
				next.st = s.st
				next.dl = n.dl
				if s.fired != "" {
					next.dl = moAddValue(n.dl, s.fired)
				}
				walk(next)
			}
		}
		if !moved {
			walk(node{seg: n.seg + 1, st: n.st, dl: n.dl})
		}
	}
	walk(node{st: st})
	return out
}

type moStep struct {
	st    moState
	fired string // a superseded task that was in flight and delivered
}

// moApply is the store's decision on reading msg in state st at the
// clock's now (CONTRACT §1).
func moApply(st moState, msg *moMsg, now, retention int64) []moStep {
	if st.kind == moMarker && st.expiry <= now {
		st = moState{} // cancel_retention over: forgotten
	}
	if st.kind != moNothing && !msg.ord.newerThan(st.ord) {
		return []moStep{{st: st}} // older than what is held: dropped
	}
	var ns moState
	switch msg.kind {
	case moSchedule:
		ns = moState{kind: moPending, ord: msg.ord, value: msg.value, due: msg.due, firing: msg.pastDue}
	case moCancel, moTombstone:
		ns = moState{kind: moMarker, ord: msg.ord, expiry: now + retention}
	default:
		panic("moApply: " + msg.kind.String())
	}
	if st.kind == moPending && st.firing {
		// Superseded in flight: its delivery may complete anyway.
		return []moStep{{st: ns}, {st: ns, fired: st.value}}
	}
	return []moStep{{st: ns}}
}

func moAddValue(dl, v string) string {
	var vs []string
	if dl != "" {
		vs = strings.Split(dl, ",")
	}
	if !slices.Contains(vs, v) {
		vs = append(vs, v)
	}
	sort.Strings(vs)
	return strings.Join(vs, ",")
}
