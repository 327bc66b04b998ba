package codec

import (
	"bytes"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// hdr classifies the header names the bridge reads or writes.
type hdr uint8

const (
	hdrOther hdr = iota
	hdrAt
	hdrAfter
	hdrTarget
	hdrKey
	hdrID
	hdrCancel
	hdrOrigin
	hdrDue
	hdrError
	hdrErrorDetail
	hdrNatsMsgID
	hdrIDEncoding
	hdrCount
)

var hdrNames = [hdrCount]string{
	hdrAt:          HeaderAt,
	hdrAfter:       HeaderAfter,
	hdrTarget:      HeaderTarget,
	hdrKey:         HeaderKey,
	hdrID:          HeaderID,
	hdrCancel:      HeaderCancel,
	hdrOrigin:      HeaderOrigin,
	hdrDue:         HeaderDue,
	hdrError:       HeaderError,
	hdrErrorDetail: HeaderErrorDetail,
	hdrNatsMsgID:   HeaderNatsMsgID,
	hdrIDEncoding:  HeaderIDEncoding,
}

// classify matches a header name case-insensitively. Most headers of real
// traffic are application headers, so the length test rejects them before
// any case folding.
func classify(k string) hdr {
	if len(k) < len(HeaderAt) || len(k) > len(HeaderErrorDetail) {
		return hdrOther
	}
	for c := hdrAt; c < hdrCount; c++ {
		if n := hdrNames[c]; len(n) == len(k) && strings.EqualFold(n, k) {
			return c
		}
	}
	return hdrOther
}

// isControl reports whether a header is one of the six control headers of
// CONTRACT §1, which are never delivered.
func (c hdr) isControl() bool { return c >= hdrAt && c <= hdrCancel }

var noRules Rules

// Parse turns a source message into the Task the engine stores. It never
// fails: a message that cannot be scheduled becomes a KindDeadLetter task
// for r.DLQ carrying a §3 code and a human detail.
//
// Header names match case-insensitively. When a control header repeats, the
// last one wins, as Kafka consumers conventionally read repeated record
// headers. A control header that is present counts even when its value is
// empty: an empty delay-at is a bad-due, not a missing one, because the
// publisher clearly meant to set it. Surrounding whitespace of control
// values is ignored, except in delay-id and delay-key, which are opaque.
//
// Cancels are checked first: delay-cancel "true" (any case) makes a cancel
// and the rest of the message is ignored; "false" or an empty value means no
// cancel; any other value is a bad-due dead letter, since the publisher's
// intent is unknown. A Kafka tombstone is a cancel of its delay-id header or
// else of its key; a tombstone with neither is a missing-due dead letter.
//
// The id of a task is the delay-id header when non-empty; otherwise the
// source key (Kafka), the Nats-Msg-Id header (NATS), and finally the origin.
//
// A schedule is delivered with every source header except the six control
// headers, plus delay-id, delay-origin and delay-due (CONTRACT §2). As an
// extension, source headers named delay-origin, delay-due or
// delay-id-encoding are dropped rather than duplicated. A source
// Nats-Msg-Id is kept (a Kafka target receives it like any header); the
// NATS sink replaces it with its own delivery id, so a JetStream target
// does not de-duplicate distinct deliveries of one publisher message id.
//
// A dead letter keeps the message unchanged, including its control headers,
// and adds delay-error, delay-error-detail and delay-origin; stale source
// copies of those three headers are dropped so that no reader sees two
// (NATS Header.Get returns the first value, Kafka readers usually the last).
// A NATS message whose id is its Nats-Msg-Id also gets it as delay-id
// (natsMsgIDOnly), since the DLQ's sink replaces Nats-Msg-Id.
//
// Also dropped from a schedule's delivery: a source's delay-error and
// delay-error-detail (a replayed dead letter's). A delay-id sent with
// delay-id-encoding: percent is decoded (delayID).
//
// The task aliases m's Key, Value and header values; it must be encoded
// (AppendTask) or copied before m's buffers are reused. r may be nil.
func Parse(m *Message, r *Rules) Task {
	if r == nil {
		r = &noRules
	}
	p := parser{m: m, r: r, stamp: m.Time.UnixMilli()}
	for i := range m.Headers {
		if c := classify(m.Headers[i].Key); c != hdrOther {
			p.last[c] = i + 1
		}
	}

	if v, ok := p.value(hdrCancel); ok {
		switch v = bytes.TrimSpace(v); {
		case bytes.EqualFold(v, []byte("true")):
			if _, useOrigin := p.idBytes(); useOrigin {
				// Its default id would be its own origin, which no task
				// has: like a keyless tombstone it would cancel nothing.
				return p.deadLetter(CodeMissingDue, "delay-cancel without a delay-id (or a Kafka key, or a Nats-Msg-Id) names no task to cancel"+p.misspelled())
			}
			return p.cancel(p.id())
		case len(v) == 0 || bytes.EqualFold(v, []byte("false")):
		default:
			return p.deadLetter(CodeBadDue, "delay-cancel must be true or false, got "+short(string(v)))
		}
	}
	if m.Tombstone {
		if v, ok := p.delayID(); ok {
			return p.cancel(string(v))
		}
		if len(m.Key) > 0 {
			return p.cancel(string(m.Key))
		}
		return p.deadLetter(CodeMissingDue, "a tombstone without a key or delay-id cancels nothing and schedules nothing"+p.misspelled())
	}

	if r.MaxBytes > 0 {
		// Bounded as delivered: the headers the bridge adds count, or a
		// message just under the limit would be taken in and then be
		// refused by the target broker on every try.
		id := p.id()
		if n := messageSize(m) + addedSize(id, p.orig()) + natsAddedSize(m.Source, id, m.Transport); n > r.MaxBytes {
			return p.deadLetter(CodeTooLarge, "message of "+strconv.Itoa(n)+" bytes as delivered (key, value, headers and the added delay-id, delay-origin, delay-due and on NATS Nats-Msg-Id) exceeds the limit of "+strconv.Itoa(r.MaxBytes))
		}
	}

	at, hasAt := p.value(hdrAt)
	after, hasAfter := p.value(hdrAfter)
	var due int64
	switch {
	case hasAt && hasAfter:
		return p.deadLetter(CodeAmbiguousDue, "both delay-at and delay-after are set; set exactly one")
	case hasAt:
		ms, err := atMs(string(bytes.TrimSpace(at)))
		if err != nil {
			return p.deadLetter(CodeBadDue, "delay-at "+err.Error())
		}
		due = ms
	case hasAfter:
		v := bytes.TrimSpace(after)
		d, ok := fastDelayMs(v)
		var err error
		if !ok {
			d, err = delayMs(string(v))
		}
		ms, inRange := addMs(p.stamp, d)
		// A well-formed delay too long for any due before year 10000 (not
		// a message time that far ahead) is a delay over max_delay, as a
		// shorter one would be: say that, not that the due cannot be
		// written.
		if r.MaxDelay > 0 && (isOverflow(err) ||
			err == nil && (!inRange || ms > MaxDue) && d > r.MaxDelay.Milliseconds()) {
			return p.deadLetter(CodeDelayTooLong, "delay-after "+short(string(v))+" is more than max_delay "+FormatDelay(r.MaxDelay))
		}
		if err != nil {
			return p.deadLetter(CodeBadDue, "delay-after "+err.Error())
		}
		if !inRange {
			return p.deadLetter(CodeBadDue, "delay-after "+short(string(after))+" overflows the due time")
		}
		due = ms
	default:
		return p.deadLetter(CodeMissingDue, "neither delay-at nor delay-after is set"+p.misspelled())
	}
	if due < MinDue || due > MaxDue {
		return p.deadLetter(CodeBadDue, "due time "+strconv.FormatInt(due, 10)+" ms lies outside 1970-01-01..9999-12-31 UTC")
	}
	if r.MaxDelay > 0 {
		// On overflow the limit lies beyond any representable due.
		from, what := p.stamp, " after the message time "
		if r.Now != nil {
			if late := r.Now().UnixMilli() + MaxClockSkew.Milliseconds(); late < from {
				// A message time well ahead of the bridge's clock (a
				// producer's CreateTime is whatever its clock said):
				// max_delay still bounds how long the task is held. Within
				// MaxClockSkew the message time stays the start, so a
				// delay-after of max_delay is not refused for the
				// milliseconds between a broker's clock and the bridge's.
				from, what = late, " after the bridge's time (plus "+FormatDelay(MaxClockSkew)+" of clock skew) "
			}
		}
		if limit, ok := addMs(from, r.MaxDelay.Milliseconds()); ok && due > limit {
			return p.deadLetter(CodeDelayTooLong, "due "+FormatDue(due)+" is more than max_delay "+FormatDelay(r.MaxDelay)+what+FormatDue(from))
		}
	}

	// The target is resolved from the header bytes: a target named in the
	// header costs no allocation of its own (see below).
	rawTarget, hasTarget := p.value(hdrTarget)
	rawTarget = bytes.TrimSpace(rawTarget)
	targetText := func() string {
		if hasTarget {
			return string(rawTarget)
		}
		return r.DefaultTarget
	}
	var (
		tr    Transport
		nameB []byte // the target name when it comes from the header
		name  string // the target name when it is the default target
		err   error
	)
	if hasTarget {
		tr, nameB, err = parseTarget(rawTarget, m.Transport)
	} else {
		if r.DefaultTarget == "" {
			return p.deadLetter(CodeMissingTarget, "delay-target is not set and the source has no default target"+p.misspelledOf(hdrTarget, hdrTarget))
		}
		tr, name, err = parseTarget(r.DefaultTarget, m.Transport)
	}
	// Details name where the target came from, so an operator can tell a
	// publisher's mistake from a configuration one.
	what := "delay-target "
	if !hasTarget {
		what = "default target "
	}
	if err != nil {
		return p.deadLetter(CodeBadTarget, what+err.Error())
	}
	if tr != m.Transport && (r.Transports == nil || !r.Transports(tr)) {
		return p.deadLetter(CodeBadTarget, what+short(targetText())+" names transport "+tr.String()+", which is not configured")
	}

	// Allocation budget of a schedule: one byte buffer holds the added
	// header values (id, origin, due) followed by the target name, one
	// string copy of it backs Task.ID, Origin and Target, and one slice
	// holds the headers. Everything else aliases the message.
	// Layout: id, origin, the default id's incarnation suffix, due,
	// target; a default id is the origin and its suffix, contiguous.
	idB, idIsOrigin := p.idBytes()
	buf := make([]byte, 0, len(idB)+originSize(m)+incarnationSuffixSize+len(dueLayout)+len(nameB))
	buf = append(buf, idB...)
	idEnd := len(buf)
	buf = m.appendOrigin(buf)
	originEnd := len(buf)
	if idIsOrigin {
		buf = appendIncarnationSuffix(buf, m.Incarnation)
	}
	suffixEnd := len(buf)
	buf = appendDue(buf, due)
	dueEnd := len(buf)
	buf = append(buf, nameB...)
	all := string(buf)
	origin := all[idEnd:originEnd]
	id, idVal := all[:idEnd], buf[:idEnd:idEnd]
	if idIsOrigin {
		id, idVal = all[idEnd:suffixEnd], buf[idEnd:suffixEnd:suffixEnd]
	}
	if hasTarget {
		name = all[dueEnd:]
	}
	p.origin = origin
	if r.DelaySource != nil && r.DelaySource(tr, name) {
		return p.deadLetter(CodeTargetNotAllowed, what+short(targetText())+" is a delay source of this bridge: delivered there without its control headers it would come back as a missing-due dead letter")
	}
	if r.Allow != nil && !r.Allow(tr, name) {
		return p.deadLetter(CodeTargetNotAllowed, what+short(targetText())+" is not matched by targets.allow")
	}

	key := m.Key
	if v, ok := p.value(hdrKey); ok {
		key = v
	}
	hs := make([]Header, 0, len(m.Headers)+3)
	for _, h := range m.Headers {
		switch c := classify(h.Key); {
		case c.isControl(), c == hdrOrigin, c == hdrDue, c == hdrIDEncoding, c == hdrError, c == hdrErrorDetail:
			continue
		}
		hs = append(hs, h)
	}
	if tr == TransportNATS {
		if enc, ok := NATSHeaderID(idVal, m.Transport); ok {
			// The consumer's dedup key (delay-id, delay-due) must tell
			// tasks apart: nats.go would trim the id and turn its CR
			// and LF into spaces, so "job-7" and "job-7 " arrived equal.
			idVal = enc
			hs = append(hs, Header{Key: HeaderIDEncoding, Value: []byte(IDEncodingPercent)})
		}
	}
	hs = append(hs,
		Header{Key: HeaderID, Value: idVal},
		Header{Key: HeaderOrigin, Value: buf[idEnd:originEnd:originEnd]},
		Header{Key: HeaderDue, Value: buf[suffixEnd:dueEnd:dueEnd]},
	)
	if tr == TransportNATS {
		if n := natsHeaderBlock(hs, m.Source, id, m.Transport); n > NATSMaxHeaderBytes {
			return p.deadLetter(CodeTooLarge, "header block of "+strconv.Itoa(n)+" bytes as delivered to NATS (the headers and the added delay-id, delay-origin, delay-due and Nats-Msg-Id) exceeds JetStream's limit of "+strconv.Itoa(NATSMaxHeaderBytes))
		}
	}

	return Task{
		Kind:         KindSchedule,
		ID:           id,
		Source:       m.Source,
		Origin:       origin,
		Stamp:        p.stamp,
		Partition:    m.Partition,
		Incarnation:  m.Incarnation,
		Offset:       m.Offset,
		Due:          due,
		Transport:    tr,
		Target:       name,
		Key:          key,
		Value:        m.Value,
		Headers:      hs,
		DLQTransport: m.Transport,
		DLQ:          r.DLQ,
	}
}

// parser carries what every outcome of Parse shares.
type parser struct {
	m *Message
	r *Rules
	// last[c] is 1 + the index of the last header of class c, 0 if
	// absent. Kept in the struct, not behind a pointer, so it stays on
	// the stack.
	last   [hdrCount]int
	stamp  int64
	origin string // set on first use: the schedule path builds its own
}

// misspelled names the first header that looks like a control header but
// is not one ("Delay_At", "X-Delay-After", "delay_id"), for the detail of
// a missing-due: a publisher who set one reads "neither delay-at nor
// delay-after is set" as a bridge fault. Only the dead-letter path pays
// for it, but there the headers are the publisher's, up to a message
// full of them: lookalike allocates nothing and stops at the first
// character that differs.
func (p *parser) misspelled() string { return p.misspelledOf(hdrAt, hdrCancel) }

// misspelledOf is misspelled for the control headers of classes from..to:
// a missing-target names only a look-alike of delay-target.
func (p *parser) misspelledOf(from, to hdr) string {
	if key, name, ok := misspelledOf(p.m, from, to); ok {
		return "; header " + short(key) + " is not read: the name is " + name + " (in any case)"
	}
	return ""
}

// Misspelled finds the first header of m that looks like a control
// header but is not one ("Delay_At", "X-Delay-After", "delay_id"): it
// returns that header's name and the control header's. Such a header is
// not read; on a message that is otherwise valid it is delivered as an
// ordinary header, and the task is scheduled without it (a delay_id
// ignored gives the task another id). Headers that cannot be one (their
// first letter is not a d or an x) cost one comparison.
func Misspelled(m *Message) (key, name string, ok bool) {
	return misspelledOf(m, hdrAt, hdrCancel)
}

// misspelledOf is Misspelled for the control headers of classes from..to.
func misspelledOf(m *Message, from, to hdr) (key, name string, ok bool) {
	for _, h := range m.Headers {
		if !maybeLookalike(h.Key) || classify(h.Key) != hdrOther {
			continue
		}
		for c := from; c <= to; c++ {
			if lookalike(h.Key, lookalikeNames[c]) || lookalike(h.Key, lookalikeNames[hdrCancel+c]) {
				return h.Key, hdrNames[c], true
			}
		}
	}
	return "", "", false
}

// maybeLookalike: the first character of key that lookalike does not
// drop is a d or an x (either case), as in every name it may match.
func maybeLookalike(key string) bool {
	for i := 0; i < len(key); i++ {
		switch key[i] {
		case '-', '_', '.', ' ':
			continue
		case 'd', 'D', 'x', 'X':
			return true
		}
		return false
	}
	return false
}

// lookalikeNames are the control header names without their '-', at
// their class, and with an "x" before them ("X-Delay-At") at class +
// hdrCancel.
var lookalikeNames = func() (n [2*hdrCancel + 1]string) {
	for c := hdrAt; c <= hdrCancel; c++ {
		n[c] = strings.ReplaceAll(hdrNames[c], "-", "")
		n[hdrCancel+c] = "x" + n[c]
	}
	return n
}()

// lookalike reports whether key is want (lower case, no separators) once
// its '-', '_', '.' and ' ' are dropped and its letters lower-cased.
func lookalike(key, want string) bool {
	i := 0
	for _, r := range key {
		switch r {
		case '-', '_', '.', ' ':
			continue
		}
		if i == len(want) || unicode.ToLower(r) != rune(want[i]) {
			return false
		}
		i++
	}
	return i == len(want)
}

// value returns the last header of class c.
func (p *parser) value(c hdr) ([]byte, bool) {
	if p.last[c] == 0 {
		return nil, false
	}
	return p.m.Headers[p.last[c]-1].Value, true
}

func (p *parser) orig() string {
	if p.origin == "" {
		p.origin = p.m.Origin()
	}
	return p.origin
}

// idBytes picks the task id: delay-id, then the Kafka key or the NATS
// Nats-Msg-Id, then the origin (reported by useOrigin), which is unique.
// Empty values are skipped: an empty id would make unrelated messages
// replace each other.
func (p *parser) idBytes() (id []byte, useOrigin bool) {
	if v, ok := p.delayID(); ok {
		return v, false
	}
	switch p.m.Transport {
	case TransportKafka:
		if len(p.m.Key) > 0 {
			return p.m.Key, false
		}
	case TransportNATS:
		if i := p.last[hdrNatsMsgID]; i > 0 && len(p.m.Headers[i-1].Value) > 0 {
			return p.m.Headers[i-1].Value, false
		}
	}
	return nil, true
}

// maxMsgIDCopy bounds the Nats-Msg-Id a dead letter repeats in delay-id,
// as written (encoded, if it is): a longer one is left out rather than
// grow the dead letter past the room README tells operators to leave.
const maxMsgIDCopy = 256

// natsMsgIDOnly is the Nats-Msg-Id of a NATS message without a (non-empty)
// delay-id, which is then its task id, as its dead letter's delay-id
// should have it: percent-encoded when the message has delay-id-encoding:
// percent, which a replay of the dead letter decodes.
func (p *parser) natsMsgIDOnly() ([]byte, bool) {
	if p.m.Transport != TransportNATS {
		return nil, false
	}
	if _, ok := p.delayID(); ok {
		return nil, false
	}
	v, ok := p.value(hdrNatsMsgID)
	if !ok || len(v) == 0 || len(v) > maxMsgIDCopy {
		return nil, false
	}
	if p.idEncoded() {
		if v = appendPercent(make([]byte, 0, 3*len(v)), v, idEncodes); len(v) > maxMsgIDCopy {
			return nil, false
		}
	}
	return v, true
}

// delayID is the non-empty delay-id header, percent-decoded when the
// message has delay-id-encoding: percent: a NATS delivery whose id was
// encoded (NATSHeaderID), republished as it arrived (a retry chain, a
// replayed dead letter), keeps its id instead of being encoded once more
// at each hop ("50%off", "50%25off", "50%2525off"). A value that is not
// valid percent-encoding is taken as it is.
func (p *parser) delayID() ([]byte, bool) {
	v, ok := p.value(hdrID)
	if !ok || len(v) == 0 {
		return nil, false
	}
	if p.idEncoded() {
		// A URL path's decoding, not a form's: '+' stays '+'.
		if d, err := url.PathUnescape(string(v)); err == nil && d != "" {
			return []byte(d), true
		}
	}
	return v, true
}

// idEncoded says whether the message has delay-id-encoding: percent.
func (p *parser) idEncoded() bool {
	enc, ok := p.value(hdrIDEncoding)
	return ok && string(bytes.TrimSpace(enc)) == IDEncodingPercent
}

func (p *parser) id() string {
	if id, useOrigin := p.idBytes(); !useOrigin {
		return string(id)
	}
	return DefaultID(p.orig(), p.m.Incarnation)
}

// incarnationSuffixSize bounds the suffix appendIncarnationSuffix adds.
const incarnationSuffixSize = len("~i") + 10

// DefaultID is the id of a message with neither delay-id nor key (Kafka)
// nor Nats-Msg-Id (NATS): its origin, which is unique within one log of
// the source partition. A topic or stream deleted and created again
// numbers its messages from the start again, so from the second
// incarnation on the id carries it ("kafka:delay/0@5~i1"): a keyless
// message of the new log never replaces an unrelated task the old log
// left pending. Incarnation 0 adds nothing, so ids of stores written
// before incarnations existed stay the same.
func DefaultID(origin string, incarnation uint32) string {
	if incarnation == 0 {
		return origin
	}
	return string(appendIncarnationSuffix([]byte(origin), incarnation))
}

func appendIncarnationSuffix(dst []byte, incarnation uint32) []byte {
	if incarnation == 0 {
		return dst
	}
	dst = append(dst, "~i"...)
	return strconv.AppendUint(dst, uint64(incarnation), 10)
}

func (p *parser) cancel(id string) Task {
	return Task{
		Kind:         KindCancel,
		ID:           id,
		Source:       p.m.Source,
		Origin:       p.orig(),
		Stamp:        p.stamp,
		Partition:    p.m.Partition,
		Incarnation:  p.m.Incarnation,
		Offset:       p.m.Offset,
		Due:          p.stamp,
		Transport:    p.m.Transport,
		DLQTransport: p.m.Transport,
		DLQ:          p.r.DLQ,
	}
}

// deadLetterDue is a dead letter's due time, from which it counts as
// overdue while its DLQ fails: when the bridge decided it (Rules.Now), not
// the message time, which a producer sets freely (0 read as 1970, and
// every age alert fired), else the message time.
func (p *parser) deadLetterDue() int64 {
	if p.r.Now != nil {
		return p.r.Now().UnixMilli()
	}
	return p.stamp
}

func (p *parser) deadLetter(code Code, detail string) Task {
	hs := make([]Header, 0, len(p.m.Headers)+3)
	for _, h := range p.m.Headers {
		switch classify(h.Key) {
		case hdrOrigin, hdrError, hdrErrorDetail:
			continue
		}
		hs = append(hs, h)
	}
	if id, ok := p.natsMsgIDOnly(); ok {
		// The DLQ's NATS sink replaces Nats-Msg-Id with its own: the
		// task id it gave would otherwise be in no header of the dead
		// letter, and a replay would run under another id, which a
		// later cancel of the id misses.
		hs = append(hs, Header{Key: HeaderID, Value: id})
	}
	hs = append(hs,
		Header{Key: HeaderError, Value: []byte(code)},
		Header{Key: HeaderErrorDetail, Value: []byte(detail)},
		Header{Key: HeaderOrigin, Value: []byte(p.orig())},
	)
	return Task{
		Kind:         KindDeadLetter,
		ID:           p.orig(),
		Source:       p.m.Source,
		Origin:       p.orig(),
		Stamp:        p.stamp,
		Partition:    p.m.Partition,
		Incarnation:  p.m.Incarnation,
		Offset:       p.m.Offset,
		Due:          p.deadLetterDue(),
		Transport:    p.m.Transport,
		Target:       p.r.DLQ,
		Key:          p.m.Key,
		Value:        p.m.Value,
		Headers:      hs,
		DLQTransport: p.m.Transport,
		DLQ:          p.r.DLQ,
		Code:         code,
		Detail:       detail,
	}
}

// DeadLetter turns a task whose delivery failed for good into a dead letter
// bound for its source's dead-letter destination (t.DLQTransport, t.DLQ).
// Key, value and the headers as they would have been delivered are kept;
// delay-error and delay-error-detail are set (replacing any earlier copies)
// and delay-origin is added only if missing. ID stays t.ID for logs and the
// admin API; a dead letter is never indexed by id. Due stays the scheduled
// due, which has passed, so the dead letter goes out at once. Attempts start
// again at 0 for the DLQ write. A detail longer than MaxDetail bytes is cut.
// t is not modified.
func DeadLetter(t *Task, code Code, detail string) Task {
	if len(detail) > MaxDetail {
		cut := MaxDetail - len("...")
		for cut > 0 && !utf8.RuneStart(detail[cut]) {
			cut--
		}
		detail = detail[:cut] + "..."
	}
	hs := make([]Header, 0, len(t.Headers)+3)
	hasOrigin := false
	for _, h := range t.Headers {
		switch classify(h.Key) {
		case hdrError, hdrErrorDetail:
			continue
		case hdrOrigin:
			if hasOrigin {
				continue
			}
			hasOrigin = true
		}
		hs = append(hs, h)
	}
	hs = append(hs,
		Header{Key: HeaderError, Value: []byte(code)},
		Header{Key: HeaderErrorDetail, Value: []byte(detail)},
	)
	if !hasOrigin {
		hs = append(hs, Header{Key: HeaderOrigin, Value: []byte(t.Origin)})
	}
	d := *t
	d.Kind = KindDeadLetter
	d.Transport = t.DLQTransport
	d.Target = t.DLQ
	d.Headers = hs
	d.Attempts = 0
	d.Code = code
	d.Detail = detail
	return d
}

// addedSize is what the headers a schedule gains (delay-id, delay-origin,
// delay-due) add to its size.
func addedSize(id, origin string) int {
	return len(HeaderID) + len(id) + headerFraming(len(HeaderID), len(id)) +
		len(HeaderOrigin) + len(origin) + headerFraming(len(HeaderOrigin), len(origin)) +
		len(HeaderDue) + dueLen + headerFraming(len(HeaderDue), dueLen)
}

// MaxClockSkew is how far a message time may be ahead of the bridge's
// clock and still be where max_delay starts (see Parse).
const MaxClockSkew = time.Minute

// natsAddedSize bounds what a NATS target adds beyond addedSize: the
// Nats-Msg-Id the sink sets ("transport:source|id|due", each part
// percent-encoded, at most 3 bytes per byte) and the header block's
// "NATS/1.0" line and closing CRLF. It is counted whatever the target's
// transport: the bound is checked before the target is resolved, and
// it costs a Kafka target a few dozen bytes of the limit.
func natsAddedSize(source, id string, from Transport) int {
	v := natsMsgIDLen(source, id)
	return len(HeaderNatsMsgID) + v + headerFraming(len(HeaderNatsMsgID), v) + len("NATS/1.0\r\n\r\n") + natsIDGrowth(id, from)
}

// natsMsgIDLen bounds the Nats-Msg-Id the NATS sink sets for a task of
// source with id ("transport:source|id|due", each part percent-encoded,
// at most 3 bytes per byte).
func natsMsgIDLen(source, id string) int {
	return len("kafka:") + 3*len(source) + 1 + 3*len(id) + 1 + dueLen
}

// NATSMaxHeaderBytes is the largest header block JetStream stores: the
// server refuses a longer one (error 10097) whatever the stream's limits.
const NATSMaxHeaderBytes = 65535

// natsHeaderBlock bounds the header block a NATS target gets for the
// delivered headers hs: the "NATS/1.0" line, each header as
// "name: value" and CRLF (a name grown as NATSHeaderName writes it), the
// sink's Nats-Msg-Id and the closing CRLF, for a message from transport
// from.
func natsHeaderBlock(hs []Header, source, id string, from Transport) int {
	n := len("NATS/1.0\r\n\r\n") + len(HeaderNatsMsgID) + natsMsgIDLen(source, id) + minHeaderFraming
	for _, h := range hs {
		n += len(h.Key) + natsNameGrowth(h.Key, from) + len(h.Value) + minHeaderFraming
	}
	return n
}

// IDEncodingPercent is the value of HeaderIDEncoding.
const IDEncodingPercent = "percent"

// natsIDAltered reports whether id, from transport from, would not arrive
// on a NATS target as a delay-id that only it can be: nats.go trims ASCII
// white space from both ends of a header value and turns CR and LF into
// spaces; and a Kafka id with a '%' in it kept as it is would read as the
// encoding of another ("job-7%20" of "job-7 "), one (delay-id, delay-due)
// for two tasks. A NATS source's ids came through a NATS header, where
// nats.go left no white space at the ends and no CR or LF, unless one was
// percent-decoded (delayID: "job-7%20" with delay-id-encoding, a Kafka
// id's delivery republished as it arrived): sent as it is, that id
// arrived altered, as another task's ("job-7"), so it is encoded as a
// Kafka one is. A '%' in a NATS source's id is kept: its ids with a '%'
// arrived as they are before ids were decoded, and still do.
func natsIDAltered[T string | []byte](id T, from Transport) bool {
	if len(id) == 0 {
		return false
	}
	switch id[0] {
	case ' ', '\t':
		return true
	}
	switch id[len(id)-1] {
	case ' ', '\t':
		return true
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c == '\r' || c == '\n' || c == '%' && from != TransportNATS {
			return true
		}
	}
	return false
}

// idEncodes reports whether NATSHeaderID writes byte c as %XX: '%', '+'
// (a form decoder reads it as a space), space, the ASCII control
// characters and DEL.
func idEncodes(c byte) bool { return c <= ' ' || c == 0x7f || c == '%' || c == '+' }

// NATSHeaderID is the delay-id header value a NATS target gets for id of a
// message from transport from, ok false when that is id itself. An id
// natsIDAltered finds is percent-encoded instead (idEncodes' bytes as
// %XX), and the delivery carries delay-id-encoding: percent. A Kafka
// source's value without that header never has a '%' in it, so its
// distinct ids never arrive as one (a NATS source's may: see
// natsIDAltered), and any percent-decoder, URL path or form, gives the
// id back.
func NATSHeaderID(id []byte, from Transport) (enc []byte, ok bool) {
	if !natsIDAltered(id, from) {
		return id, false
	}
	return appendPercent(make([]byte, 0, 3*len(id)), id, idEncodes), true
}

// natsIDGrowth is what NATSHeaderID adds to a NATS delivery of id: two
// bytes per byte it encodes and the delay-id-encoding header; none for an
// id NATS carries as it is.
func natsIDGrowth(id string, from Transport) int {
	if !natsIDAltered(id, from) {
		return 0
	}
	n := 0
	for i := 0; i < len(id); i++ {
		if idEncodes(id[i]) {
			n += 2
		}
	}
	return n + len(HeaderIDEncoding) + len(IDEncodingPercent) + headerFraming(len(HeaderIDEncoding), len(IDEncodingPercent))
}

// MaxDetail bounds a dead letter's delay-error-detail, in bytes.
const MaxDetail = 1024

// DeadLetterOverhead bounds what DeadLetter adds to a task's size beyond
// its origin: the delay-error and delay-error-detail headers.
const DeadLetterOverhead = len(HeaderError) + 32 + len(HeaderErrorDetail) + MaxDetail + len(HeaderOrigin) + 3*minHeaderFraming

// messageSize is what MaxBytes bounds, with addedSize: key, value and every
// header name and value with its framing.
func messageSize(m *Message) int {
	n := len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		// A name NATS cannot carry grows on a NATS target (NATSHeaderName).
		n += len(h.Key) + natsNameGrowth(h.Key, m.Transport) + len(h.Value) + headerFraming(len(h.Key), len(h.Value))
	}
	return n
}

// minHeaderFraming is what a header costs on NATS beyond its name and
// value (": " and CRLF).
const minHeaderFraming = 4

// headerFraming is what one header of a delivered message costs beyond its
// name and value: on Kafka the two zig-zag varint lengths of a record
// header (1 to 3 bytes each for what fits a message), on NATS
// minHeaderFraming; the larger of the two. Without it, a message with
// hundreds of headers just under the limit was taken in and then refused
// by every target (and its publish-failed dead letter by the DLQ).
func headerFraming(k, v int) int {
	return max(minHeaderFraming, zigzagLen(k)+zigzagLen(v))
}

// zigzagLen is the length of Kafka's zig-zag varint of n >= 0.
func zigzagLen(n int) int {
	l := 1
	for u := uint64(n) << 1; u >= 0x80; u >>= 7 {
		l++
	}
	return l
}
