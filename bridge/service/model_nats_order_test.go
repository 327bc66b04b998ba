package service

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/shard"
)

// TestNATSOrderModel is TestKafkaOrderModel's approach on the NATS source:
// random histories of schedules, replaces and cancels of a small id space
// published to several subjects under the delay stream's delay.>, across
// graceful restarts of the bridge (also as soon as the server delivered it
// a message, mostly before the bridge acked it), with every id's
// deliveries checked against the same model of CONTRACT §1 (moEnumerate)
// and every delivery's headers against §2 and §3, and the store's lookup
// of every id against the model after each round.
//
// What is NATS's own. The id is delay-id, else the Nats-Msg-Id header
// (also after an empty delay-id), else the origin nats:DELAY#SEQ. The
// broker timestamp is the JetStream stored time, which the server assigns:
// the whole stream counts as one partition, so between two messages of an
// id the later stream sequence wins, whatever their times; a cancel is
// remembered like on Kafka, but in one stream read in order no older
// schedule can follow it, so cancel_retention never decides an outcome
// here. The stream the bridge creates de-duplicates Nats-Msg-Id within
// 100 ms: a message that repeats a recent one's is dropped by the server
// (the PubAck says so) and the model never sees it; replaces that reuse an
// id's Nats-Msg-Id mostly wait out the window first, so both cases occur.
// A cancel with no delay-id and no Nats-Msg-Id names no task: a
// missing-due dead letter. delay-after counts from the stored time (read
// back from the stream), which is real time, not the bridge's injected
// clock. Targets are NATS subjects (bare and with nats:) and the Kafka
// topic (kafka:, in any case); a NATS delivery's Nats-Msg-Id is the
// bridge's SOURCE|id|due, a Kafka one's headers are the source's sorted by
// name (the source's Nats-Msg-Id among them) and then the three the
// bridge adds.
//
// A quarter of the rounds are published while the bridge is down; the
// next run reads them in its catch-up pause (README "After an outage:
// catching up"), so the model lets none of their past dues fire before
// the whole round is read. In half of those the outage lasts until every
// task the store holds is due, and the backlog cancels or replaces each
// first thing: none of them may fire. Half the seeds run the bridge
// without Kafka (and kafka: targets), whose group join would otherwise
// outlast the NATS source's catch-up.
//
// The seed is logged; DELAYBRIDGE_MODEL_SEED=N replays its history (the
// messages published depend on the seed alone; which of those that repeat
// a Nats-Msg-Id without waiting out the window the server drops depends
// on timing, and the model follows the PubAcks). The short form runs 12
// rounds of 16 messages; DELAYBRIDGE_LONG=1 runs 60 of 30.
func TestNATSOrderModel(t *testing.T) {
	seed := modelSeed(t)
	rounds, opsPerRound := 12, 16
	if os.Getenv("DELAYBRIDGE_LONG") != "" {
		rounds, opsPerRound = 60, 30
	}
	t.Logf("seed %d (replay: DELAYBRIDGE_MODEL_SEED=%d)", seed, seed)
	m := newNATSModel(t, seed)
	for r := range rounds {
		m.round(r, opsPerRound, false)
	}
	m.round(rounds, 0, true) // the long dues
	t.Logf("seed %d: NATS only %v, %d rounds, %d messages stored, %d dropped by the stream as duplicate Nats-Msg-Ids, %d deliveries checked, %d duplicates, %d restarts (%d right after a delivery, %d of them with it not acked), %d rounds read after an outage that let %d stored tasks come due, %d ambiguous id-rounds",
		seed, m.natsOnly, rounds, m.nmsgs, m.dropped, m.checked, m.dups, m.restarts, m.hotStops, m.unacked, m.outages, m.outageDue, m.ambiguous)
	if t.Failed() {
		t.Logf("replay: DELAYBRIDGE_MODEL_SEED=%d", seed)
	}
}

// modelSeed is DELAYBRIDGE_MODEL_SEED, or a random seed.
func modelSeed(t *testing.T) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("DELAYBRIDGE_MODEL_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("DELAYBRIDGE_MODEL_SEED: %v", err)
		}
		seed = n
	}
	return seed
}

const (
	nmStream  = "DELAY"     // the delay stream (env's config)
	nmDLQ     = "dlq.delay" // its dead-letter subject
	nmWindow  = 100 * time.Millisecond
	nmConsume = "bridge" // the bridge's durable consumer
)

// nmMsg is one message published to a delay subject.
type nmMsg struct {
	*moMsg
	subject string
	msgID   string // the Nats-Msg-Id sent, "" none
	idHdr   bool   // the id was sent as delay-id (not only as Nats-Msg-Id)
	target  string // the delay-target sent
	code    string // the dead letter's delay-error (kind moBad)
	sent    []codec.Header
	// The JetStream stored time lies in [storedLo, storedHi] (ms): the
	// wall clock before the publish and after its PubAck. The stream is a
	// work queue: the message is gone once the bridge acked it, so its
	// time cannot be read back. A delay-after's due lies in [due, dueHi]
	// until a delivery's delay-due tells it.
	storedLo, storedHi int64
	after              int64 // the delay-after sent, ms; -1 delay-at
	dueHi              int64
}

func (m *nmMsg) String() string {
	s := m.moMsg.String() + " subject=" + m.subject
	if m.msgID != "" {
		s += " msgid=" + m.msgID
	}
	if m.target != "" {
		s += " target=" + m.target
	}
	return s
}

type natsModel struct {
	t         *testing.T
	e         *env
	rng       *rand.Rand
	js        jetstream.JetStream
	svc       *Service
	stop      func()
	down      bool
	lastSeq   uint64
	msgIDAt   map[string]int64     // per Nats-Msg-Id: when the last message with it was stored, at the latest
	states    map[string][]moState // per id: the states the history so far allows
	msgs      []*nmMsg             // every message stored, in stream order
	byValue   map[string]*nmMsg
	read      int
	delivered map[string]bool
	retention int64
	nmsgs     int
	dropped   int
	checked   int
	dups      int
	restarts  int
	hotStops  int
	unacked   int  // hot stops that found the last message delivered and not acked
	natsOnly  bool // the bridge has no Kafka: no kafka: targets
	outages   int  // rounds published while the bridge was down and the clock moved on
	outageDue int  // tasks that came due in those outages, cancelled or replaced in the backlog
	ambiguous int
}

func newNATSModel(t *testing.T, seed uint64) *natsModel {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	secs := 15 + rng.IntN(45)
	m := &natsModel{t: t, e: newEnv(t, fmt.Sprintf("cancel_retention: %ds\n", secs)), rng: rng, retention: int64(secs) * 1000,
		msgIDAt: map[string]int64{}, states: map[string][]moState{}, byValue: map[string]*nmMsg{}, delivered: map[string]bool{}}
	for i := range moIDs {
		m.states["id"+strconv.Itoa(i)] = []moState{{}}
	}
	if m.natsOnly = rng.IntN(2) == 0; m.natsOnly {
		// No Kafka: its group join (half a second) does not hide how
		// long the NATS source takes to catch up after a restart.
		m.e.mutate = func(c *config.Config) { c.Kafka = nil }
	}
	var err error
	if m.js, err = jetstream.New(m.e.nc); err != nil {
		t.Fatal(err)
	}
	m.svc, m.stop = m.e.start()
	eventually(t, "the bridge ready", func() bool { return m.svc.Ready() == nil })
	return m
}

func (m *natsModel) now() int64 { return m.e.clk.Now().UnixMilli() }

func (m *natsModel) ctl(name, value string) codec.Header {
	return codec.Header{Key: randCase(m.rng, name), Value: []byte(value)}
}

// idHeaders picks how msg names its id: by Nats-Msg-Id alone (the
// default id; also with an empty delay-id), by delay-id with a fresh
// Nats-Msg-Id, with none, or with another id's Nats-Msg-Id (which alone
// would name the wrong task, and which the stream drops if that id's last
// message was stored within the window).
func (m *natsModel) idHeaders(msg *nmMsg) []codec.Header {
	switch r := m.rng.IntN(5); r {
	case 0, 4:
		msg.msgID = msg.id
		if last, ok := m.msgIDAt[msg.id]; ok && m.rng.IntN(4) > 0 {
			// A replace that reuses the Nats-Msg-Id after the window,
			// as README says to: the stream stores it.
			if wait := time.Until(time.UnixMilli(last).Add(2 * nmWindow)); wait > 0 {
				time.Sleep(wait)
			}
		}
		if r == 4 {
			return []codec.Header{m.ctl("delay-id", "")}
		}
		return nil
	case 1:
		msg.msgID = "m" + strconv.Itoa(msg.n)
	case 2:
	case 3:
		msg.msgID = "id" + strconv.Itoa(m.rng.IntN(moIDs))
	}
	msg.idHdr = true
	return []codec.Header{m.ctl("delay-id", msg.id)}
}

// target picks a delay-target: a NATS subject bare or with its prefix, or
// the Kafka topic.
func (m *natsModel) target(msg *nmMsg) string {
	r := m.rng.IntN(5)
	if m.natsOnly && (r == 2 || r == 3) {
		r = 4
	}
	switch r {
	case 0:
		msg.target = "nats:orders.n"
	case 1:
		msg.target = "NATS:orders.m.x"
	case 2:
		msg.target = "kafka:" + kafkaOut
	case 3:
		msg.target = "Kafka:" + kafkaOut
	default:
		msg.target = "orders.bare"
	}
	return msg.target
}

// natsTarget is where a target arrives: transport and topic or subject.
func natsTarget(target string) (string, string) {
	if tr, name, ok := strings.Cut(target, ":"); ok {
		return strings.ToLower(tr), name
	}
	return "nats", target
}

// dueHeader sets msg's intended due (a sixth in the past, a sixth beyond
// the round, the rest 5 to 30 s ahead of the standing clock) and returns
// its header and, for delay-after, the delay in ms (-1: delay-at). A
// delay-after counts from the stored time, which is real time: publish
// bounds msg.due once the stream has stored the message. Dues in the past
// are delay-at only, so a due's bounds never straddle the clock.
func (m *natsModel) dueHeader(msg *nmMsg) (codec.Header, int64) {
	now := m.now()
	switch r := m.rng.IntN(6); {
	case r == 0:
		msg.due = now - int64(m.rng.IntN(5000))
	case r == 1:
		msg.due = now + 60_000 + int64(m.rng.IntN(120_000))
		msg.long = true
	default:
		msg.due = now + 5000 + int64(m.rng.IntN(25_000))
	}
	// A second apart from every due of this id's schedules so far: two
	// deliveries of one id with one due carry one Nats-Msg-Id
	// (DELAY|id|due), and the ORDERS stream would drop the second within
	// its 2 min duplicate window, which the model does not expect. A
	// delay-after's due lies within its publish's round trip of the
	// intended one.
	for clash := true; clash && msg.id != ""; {
		clash = false
		for _, o := range m.msgs {
			if o.kind == moSchedule && o.id == msg.id && msg.due > o.due-1000 && msg.due < o.dueHi+1000 {
				msg.due, clash = o.dueHi+1000, true
			}
		}
	}
	// The stored time will be a little after the wall clock's now.
	after := msg.due - time.Now().UnixMilli()
	future := msg.due > now
	switch r := m.rng.IntN(4); {
	case r == 0 && after >= 0 && future:
		return m.ctl("delay-after", strconv.FormatInt(after, 10)), after
	case r == 1 && after >= 0 && future:
		return m.ctl("delay-after", (time.Duration(after) * time.Millisecond).String()), after
	case r == 2:
		return m.ctl("delay-at", strconv.FormatInt(msg.due, 10)), -1
	}
	return m.ctl("delay-at", codec.FormatDue(msg.due)), -1
}

const nmNoIDCancel moKind = -1 // randomKind's cancel without any id: published as moBad

func (m *natsModel) randomKind() moKind {
	switch r := m.rng.IntN(100); {
	case r < 52:
		return moSchedule
	case r < 77:
		return moCancel
	case r < 87:
		return moAnon
	case r < 94:
		return moBad
	}
	return nmNoIDCancel
}

// publish makes and publishes one message of the round; it returns nil if
// the stream dropped it as a duplicate.
func (m *natsModel) publish(round, seg int, id string, kind moKind) *nmMsg {
	t := m.t
	t.Helper()
	n := m.nmsgs + m.dropped + 1
	msg := &nmMsg{moMsg: &moMsg{n: n, round: round, seg: seg, kind: kind, id: id}}
	msg.subject = []string{"delay.a", "delay.b.c", "delay.orders." + strconv.Itoa(m.rng.IntN(3))}[m.rng.IntN(3)]
	var src, ctl []codec.Header
	if m.rng.IntN(2) == 0 {
		src = append(src, codec.Header{Key: "x-n", Value: []byte(strconv.Itoa(n))})
	}
	if m.rng.IntN(3) == 0 {
		src = append(src, codec.Header{Key: "x-multi", Value: []byte("a")}, codec.Header{Key: "x-multi", Value: []byte("b")})
	}
	after := int64(-1)
	var value string
	switch kind {
	case moSchedule, moAnon:
		msg.value = fmt.Sprintf("r%dv%d", round, n)
		value = msg.value
		if kind == moSchedule {
			ctl = m.idHeaders(msg)
		} else {
			msg.id = ""
		}
		var h codec.Header
		h, after = m.dueHeader(msg)
		ctl = append(ctl, h, m.ctl("delay-target", m.target(msg)))
		if m.rng.IntN(4) == 0 {
			msg.dkey = "dk" + strconv.Itoa(n)
			ctl = append(ctl, m.ctl("delay-key", msg.dkey))
		}
		msg.srcHdrs = src
	case moCancel:
		ctl = append(m.idHeaders(msg), m.ctl("delay-cancel", "true"))
		if m.rng.IntN(2) == 0 {
			// A cancel's payload and other control headers are ignored.
			ctl = append(ctl, m.ctl("delay-target", "orders.bare"), m.ctl("delay-after", "1s"))
		}
		value = "ignored"[:m.rng.IntN(8)]
	case moBad:
		msg.value = fmt.Sprintf("r%dbad%d", round, n)
		value = msg.value
		msg.code = string(codec.CodeBadDue)
		if m.rng.IntN(2) == 0 {
			msg.idHdr = true
			ctl = []codec.Header{m.ctl("delay-id", id)}
		} else {
			msg.msgID = id // the id is its Nats-Msg-Id: the dead letter carries it as delay-id
		}
		ctl = append(ctl, m.ctl("delay-after", "soon"), m.ctl("delay-target", "orders.bare"))
	case nmNoIDCancel:
		// Names no task: a missing-due dead letter.
		msg.kind, msg.id = moBad, ""
		msg.value = fmt.Sprintf("r%dnoid%d", round, n)
		value = msg.value
		msg.code = string(codec.CodeMissingDue)
		ctl = []codec.Header{m.ctl("delay-cancel", "true")}
	}
	msg.sent = interleave(m.rng, src, ctl)
	nm := natsgo.NewMsg(msg.subject)
	nm.Data = []byte(value)
	if msg.msgID != "" {
		nm.Header.Set(jetstream.MsgIDHeader, msg.msgID)
		msg.sent = append(msg.sent, codec.Header{Key: jetstream.MsgIDHeader, Value: []byte(msg.msgID)})
	}
	for _, h := range msg.sent {
		if h.Key != jetstream.MsgIDHeader {
			nm.Header.Add(h.Key, string(h.Value))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	lo := time.Now().UnixMilli()
	ack, err := m.js.PublishMsg(ctx, nm)
	hi := time.Now().UnixMilli()
	if err != nil {
		t.Fatalf("publish %s: %v", msg, err)
	}
	if ack.Duplicate {
		m.dropped++
		return nil
	}
	if ack.Sequence != m.lastSeq+1 {
		t.Fatalf("%s stored at sequence %d, want %d", msg, ack.Sequence, m.lastSeq+1)
	}
	m.lastSeq = ack.Sequence
	return m.stored(msg, ack.Sequence, lo, hi, after)
}

func (m *natsModel) stored(msg *nmMsg, seq uint64, lo, hi, after int64) *nmMsg {
	msg.storedLo, msg.storedHi, msg.after = lo, hi, after
	if msg.msgID != "" {
		m.msgIDAt[msg.msgID] = hi
	}
	// The whole stream is partition 0, ordered by sequence.
	msg.ord = moOrder{stamp: lo, part: 0, off: int64(seq)}
	msg.origin = fmt.Sprintf("nats:%s#%d", nmStream, seq)
	msg.dueHi = msg.due
	if after >= 0 {
		msg.due, msg.dueHi = lo+after, hi+after
	}
	msg.pastDue = (msg.kind == moSchedule || msg.kind == moAnon) && msg.due <= m.now()
	m.nmsgs++
	m.msgs = append(m.msgs, msg)
	if msg.value != "" {
		m.byValue[msg.value] = msg
	}
	return msg
}

// barrier waits until the bridge acked every message stored (an ack
// follows the store's fsync, CONTRACT §4).
func (m *natsModel) barrier() {
	m.t.Helper()
	if m.down {
		m.startBridge()
	}
	eventually(m.t, "the bridge to ack every stored message", func() bool {
		ci, err := m.consumerInfo()
		return err == nil && ci.AckFloor.Stream >= m.lastSeq
	})
}

func (m *natsModel) startBridge() {
	m.svc, m.stop = m.e.start()
	m.down = false
}

func (m *natsModel) stopBridge() {
	m.stop()
	m.down = true
	m.restarts++
}

// consumerInfo is the bridge's durable consumer's state.
func (m *natsModel) consumerInfo() (*jetstream.ConsumerInfo, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := m.js.Consumer(ctx, nmStream, nmConsume)
	if err != nil {
		return nil, err
	}
	return c.Info(ctx)
}

// hotStop stops the bridge as soon as the server delivered it the last
// message stored (or after 200 ms), so the stop often finds messages
// delivered and not acked; it counts those stops.
func (m *natsModel) hotStop() {
	deadline := time.Now().Add(200 * time.Millisecond)
	var ci *jetstream.ConsumerInfo
	for time.Now().Before(deadline) {
		var err error
		if ci, err = m.consumerInfo(); err == nil && ci.Delivered.Stream >= m.lastSeq {
			break
		}
		time.Sleep(time.Millisecond)
	}
	m.stopBridge()
	m.hotStops++
	if ci != nil && ci.Delivered.Stream >= m.lastSeq && ci.AckFloor.Stream < m.lastSeq {
		m.unacked++
	}
}

// round is orderModel.round on the NATS source: ops random messages with
// barriers and restarts between some of them, then the clock past every
// due of the round (with drain: of the history), the deliveries read back
// and checked.
func (m *natsModel) round(r, ops int, drain bool) {
	t := m.t
	t.Helper()
	seg := 0
	first := len(m.msgs)
	var active []string
	for _, i := range m.rng.Perm(moIDs)[:2+m.rng.IntN(moIDs-1)] {
		active = append(active, "id"+strconv.Itoa(i))
	}
	burst := ops > 0 && m.rng.IntN(4) == 0
	if burst {
		// The whole round is published while the bridge is down: the next
		// run reads it in large batches, in its catch-up pause (README
		// "After an outage: catching up"), so nothing fires before all of
		// it is read: the round's past dues are not "firing" to the model.
		// In half of them the outage lasts: the clock moves on first, and
		// what the store holds comes due while the bridge is away, to be
		// cancelled or replaced by the backlog all the same.
		if !m.down {
			m.stopBridge()
		}
		if m.rng.IntN(2) == 0 {
			// Long enough for every task stored to come due.
			d := int64(m.rng.IntN(20_000))
			var due []string
			for i := range moIDs {
				id := "id" + strconv.Itoa(i)
				for _, st := range m.states[id] {
					if st.kind == moPending {
						d = max(d, st.due-m.now()+int64(m.rng.IntN(5000)))
						due = append(due, id)
						break
					}
				}
			}
			m.e.clk.Advance(time.Duration(d) * time.Millisecond)
			m.outages++
			m.outageDue += len(due)
			// Their publishers cancel or replace them first thing.
			for _, id := range due {
				if msg := m.publish(r, seg, id, []moKind{moCancel, moSchedule}[m.rng.IntN(2)]); msg != nil {
					msg.pastDue = false
				}
			}
		}
	}
	for range ops {
		msg := m.publish(r, seg, active[m.rng.IntN(len(active))], m.randomKind())
		if burst {
			if msg != nil {
				msg.pastDue = false
			}
			continue
		}
		switch x := m.rng.IntN(100); {
		case x < 20:
			m.barrier()
			seg++
		case x < 24 && !m.down:
			// Graceful stop; the bridge stays down for the next messages
			// until a barrier or the next restart point starts it.
			m.stopBridge()
		case x < 28 && !m.down && msg != nil:
			// Right after the bridge pulled it: it may hold it not
			// yet acked (or not stored), which the next run must read.
			m.hotStop()
		case x < 34 && m.down:
			m.startBridge()
		}
	}
	m.barrier()
	msgs := m.msgs[first:]
	now := m.now()
	for _, d := range m.e.deliveries() {
		if msg := m.byValue[d.value]; msg != nil && msg.kind != moBad && msg.due > now {
			t.Errorf("round %d: %s delivered before the clock (%d) reached its due", r, msg, now)
		}
	}
	end := now
	for _, msg := range m.msgs {
		if (msg.round == r && !msg.long) || drain {
			end = max(end, msg.dueHi+1000)
		}
	}
	if m.rng.IntN(2) == 0 {
		end += int64(m.rng.IntN(40_000))
	}
	for _, msg := range m.msgs {
		if msg.due <= end && end < msg.dueHi {
			end = msg.dueHi // not within a due's bounds: it came due or not
		}
	}
	end = passDues(t, m.e, m.rng, func() *Service { return m.svc }, func() {
		m.stopBridge()
		m.startBridge()
	}, nmStream, now, end)
	m.readAll()
	m.check(r, msgs, now, end)
}

// readAll waits until the test's consumers have read as many messages
// from the targets and the DLQ as the brokers hold.
func (m *natsModel) readAll() {
	m.t.Helper()
	om := &orderModel{e: m.e}
	eventually(m.t, "every delivered message read back", func() bool {
		n, err := om.endOffsets(kafkaOut, kafkaDLQ)
		if err != nil {
			return false
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, name := range []string{"ORDERS", "DLQ"} {
			s, err := m.js.Stream(ctx, name)
			if err != nil {
				return false
			}
			si, err := s.Info(ctx)
			if err != nil {
				return false
			}
			n += int64(si.State.Msgs)
		}
		return int64(len(m.e.deliveries())) == n
	})
}

// check compares the round's deliveries with the model.
func (m *natsModel) check(r int, msgs []*nmMsg, now, end int64) {
	t := m.t
	all := m.e.deliveries()
	fresh := all[m.read:]
	m.read = len(all)
	got := map[string]bool{}
	for _, d := range fresh {
		msg := m.byValue[d.value]
		if msg == nil {
			t.Errorf("round %d: unexpected delivery %q to %s:%s", r, d.value, d.transport, d.dest)
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
			m.delivered[msg.value] = true
		}
	}
	for i := range moIDs {
		id := "id" + strconv.Itoa(i)
		var mine []*moMsg
		for _, msg := range msgs {
			if msg.id == id && msg.kind != moBad {
				mine = append(mine, msg.moMsg)
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
		next, allowed, ok, _ := moJudge(m.states[id], mine, observed, now, end, m.retention)
		if len(allowed) > 1 {
			m.ambiguous++
		}
		if !ok {
			t.Errorf("round %d, %s: delivered {%s}; the model allows only %v", r, id, observed, allowed)
			t.Logf("  clock %d while ingesting, then %d; states at the round's start: %v", now, end, m.states[id])
			for _, msg := range msgs {
				if msg.id == id {
					t.Logf("  %s", msg)
				}
			}
		}
		m.states[id] = next
		m.checkStored(r, id)
	}
}

// checkStored compares the store's lookup of id with the model, where the
// model allows one pending task or none.
func (m *natsModel) checkStored(r int, id string) {
	sts := m.states[id]
	if len(sts) == 0 {
		return
	}
	pending := sts[0].kind == moPending
	for _, st := range sts[1:] {
		if (st.kind == moPending) != pending || pending && st.value != sts[0].value {
			return
		}
	}
	ti, err := m.svc.Engine().Lookup(nmStream, id)
	switch {
	case !pending && !errors.Is(err, shard.ErrNotFound):
		m.t.Errorf("round %d, %s: the store holds %+v (err %v); the model holds %v", r, id, ti, err, sts)
	case pending && err != nil:
		m.t.Errorf("round %d, %s: lookup: %v; the model holds %v", r, id, err, sts)
	case pending:
		msg := m.byValue[sts[0].value]
		tr, name := natsTarget(msg.target)
		if ti.Origin != msg.origin || ti.Due.UnixMilli() < msg.due || ti.Due.UnixMilli() > msg.dueHi || ti.Target != tr+":"+name {
			m.t.Errorf("round %d, %s: the store holds %+v; the model holds %s", r, id, ti, msg)
		}
	}
}

// canonHeaders is hs as NATS keeps them: sorted by name, the values of one
// name in order.
func canonHeaders(hs []codec.Header) []string {
	hs = slices.Clone(hs)
	slices.SortStableFunc(hs, func(a, b codec.Header) int { return cmp.Compare(a.Key, b.Key) })
	out := make([]string, 0, len(hs))
	for _, h := range hs {
		out = append(out, h.Key+"="+string(h.Value))
	}
	return out
}

// checkDelivery checks one delivery against CONTRACT §2 (a schedule) or §3
// (a dead letter) and README's NATS additions.
func (m *natsModel) checkDelivery(msg *nmMsg, d delivery) {
	t := m.t
	m.checked++
	if msg.kind == moBad {
		// Unchanged, but for the error headers and the bridge's own
		// Nats-Msg-Id; an id given only as Nats-Msg-Id comes as delay-id.
		var want []codec.Header
		for _, h := range msg.sent {
			if h.Key != jetstream.MsgIDHeader {
				want = append(want, h)
			}
		}
		if !msg.idHdr && msg.msgID != "" {
			want = append(want, codec.Header{Key: codec.HeaderID, Value: []byte(msg.msgID)})
		}
		want = append(want, codec.Header{Key: codec.HeaderError, Value: []byte(msg.code)}, codec.Header{Key: codec.HeaderOrigin, Value: []byte(msg.origin)})
		var gotH []codec.Header
		for _, h := range d.headers {
			if h.Key != codec.HeaderErrorDetail && h.Key != jetstream.MsgIDHeader {
				gotH = append(gotH, h)
			}
		}
		if d.transport != "nats" || d.dest != nmDLQ || d.header(codec.HeaderErrorDetail) == "" ||
			!strings.HasPrefix(d.header(jetstream.MsgIDHeader), "nats:"+nmStream+"|"+msg.origin+"|") ||
			!slices.Equal(canonHeaders(gotH), canonHeaders(want)) {
			t.Errorf("%s: dead letter to %s:%s headers %q, want %q plus %s and %s", msg, d.transport, d.dest,
				canonHeaders(d.headers), canonHeaders(want), codec.HeaderErrorDetail, jetstream.MsgIDHeader)
		}
		return
	}
	if msg.due != msg.dueHi {
		// A delay-after: its delay-due tells the stored time.
		at, err := time.Parse(time.RFC3339Nano, d.header(codec.HeaderDue))
		if ms := at.UnixMilli(); err != nil || ms < msg.due || ms > msg.dueHi {
			t.Errorf("%s delivered with delay-due %q, want one in %s..%s (the stored time plus %d ms)", msg, d.header(codec.HeaderDue),
				codec.FormatDue(msg.due), codec.FormatDue(msg.dueHi), msg.after)
		} else {
			msg.due, msg.dueHi = at.UnixMilli(), at.UnixMilli()
		}
	}
	tr, dest := natsTarget(msg.target)
	if d.transport != tr || d.dest != dest {
		t.Errorf("%s delivered to %s:%s (error %q)", msg, d.transport, d.dest, d.header(codec.HeaderError))
		return
	}
	if d.at.UnixMilli() < msg.due {
		t.Errorf("%s delivered at %v, before its due %v", msg, d.at, time.UnixMilli(msg.due))
	}
	id := msg.id
	if msg.kind == moAnon {
		id = msg.origin
	}
	due := codec.FormatDue(msg.due)
	added := []codec.Header{{Key: codec.HeaderID, Value: []byte(id)}, {Key: codec.HeaderOrigin, Value: []byte(msg.origin)}, {Key: codec.HeaderDue, Value: []byte(due)}}
	var gotH []string
	for _, h := range d.headers {
		gotH = append(gotH, h.Key+"="+string(h.Value))
	}
	if tr == "kafka" {
		// No key on a NATS source: the delay-key, or none.
		if d.key != msg.dkey {
			t.Errorf("%s delivered with key %q, want %q", msg, d.key, msg.dkey)
		}
		src := slices.Clone(msg.srcHdrs)
		if msg.msgID != "" {
			src = append(src, codec.Header{Key: jetstream.MsgIDHeader, Value: []byte(msg.msgID)})
		}
		want := canonHeaders(src)
		for _, h := range added {
			want = append(want, h.Key+"="+string(h.Value))
		}
		if !slices.Equal(gotH, want) {
			t.Errorf("%s delivered with headers\n got  %v\n want %v", msg, gotH, want)
		}
		return
	}
	want := append(slices.Clone(msg.srcHdrs), added...)
	want = append(want, codec.Header{Key: jetstream.MsgIDHeader, Value: []byte("nats:" + nmStream + "|" + id + "|" + due)})
	if !slices.Equal(canonHeaders(d.headers), canonHeaders(want)) {
		t.Errorf("%s delivered with headers\n got  %v\n want %v", msg, canonHeaders(d.headers), canonHeaders(want))
	}
}
