// Package codec turns a source message into a Task by reading the delay
// control headers of the contract (CONTRACT §1), and frames Tasks for the
// durable store as a versioned, checksummed envelope.
//
// Parsing never fails: input that cannot be scheduled yields a Task of kind
// KindDeadLetter carrying one of the §3 codes, so bad input takes the same
// durable road as good input and nothing is lost.
//
// Memory: a parsed Task aliases its Message's key, value and header values
// (Parse is on the ingest hot path and costs three allocations for a
// schedule), while DecodeTask copies out of its input, because store values
// are only valid until the iterator moves.
package codec

import (
	"strconv"
	"time"
	"unsafe"
)

// Control headers read from a source message (matched case-insensitively)
// and headers the bridge adds on delivery or dead-lettering.
const (
	HeaderAt     = "delay-at"
	HeaderAfter  = "delay-after"
	HeaderTarget = "delay-target"
	HeaderKey    = "delay-key"
	HeaderID     = "delay-id"
	HeaderCancel = "delay-cancel"

	HeaderOrigin      = "delay-origin"
	HeaderDue         = "delay-due"
	HeaderError       = "delay-error"
	HeaderErrorDetail = "delay-error-detail"

	// HeaderIDEncoding ("percent") marks a delay-id delivered
	// percent-encoded to a NATS target, which cannot carry the id as it
	// is (see NATSHeaderID). The bridge sets it; a publisher's is dropped.
	HeaderIDEncoding = "delay-id-encoding"

	// HeaderNatsMsgID is the JetStream de-duplication header; on NATS sources
	// it is the default task id.
	HeaderNatsMsgID = "Nats-Msg-Id"
)

// Code is a dead-letter reason of CONTRACT §3.
type Code string

// The dead-letter codes of CONTRACT §3.
const (
	CodeMissingDue       Code = "missing-due"
	CodeAmbiguousDue     Code = "ambiguous-due"
	CodeBadDue           Code = "bad-due"
	CodeDelayTooLong     Code = "delay-too-long"
	CodeMissingTarget    Code = "missing-target"
	CodeBadTarget        Code = "bad-target"
	CodeTargetNotAllowed Code = "target-not-allowed"
	CodeTooLarge         Code = "too-large"
	CodePublishFailed    Code = "publish-failed"
)

// Codes lists every dead-letter code, for metrics and docs.
var Codes = []Code{
	CodeMissingDue, CodeAmbiguousDue, CodeBadDue, CodeDelayTooLong,
	CodeMissingTarget, CodeBadTarget, CodeTargetNotAllowed, CodeTooLarge,
	CodePublishFailed,
}

// Transport names a broker family.
type Transport uint8

// Transports. The zero value is invalid so a forgotten field is caught.
const (
	TransportKafka Transport = 1
	TransportNATS  Transport = 2
)

func (t Transport) String() string {
	switch t {
	case TransportKafka:
		return "kafka"
	case TransportNATS:
		return "nats"
	}
	return "transport(" + strconv.Itoa(int(t)) + ")"
}

// Header is one message header. Kafka allows repeated keys, so headers are a
// slice, not a map; order is kept.
type Header struct {
	Key   string
	Value []byte
}

// HeaderMemory is what a decoded Header costs beyond its bytes: 40 on a
// 64-bit machine. Memory bounds count it per header, as a message of
// many empty headers decodes to many times its size on the wire.
const HeaderMemory = int(unsafe.Sizeof(Header{}))

// Message is a source message as a transport adapter hands it over.
type Message struct {
	Transport Transport
	// Source is the delay topic (Kafka) or stream (NATS). Task ids are scoped
	// to it.
	Source string
	// Partition and Offset locate the message: Kafka partition and offset;
	// for NATS partition 0 and the stream sequence.
	Partition int32
	Offset    int64
	// Incarnation tells apart the logs a partition has had: a Kafka topic
	// or JetStream stream deleted and created again numbers its messages
	// from the start again. Offsets order messages only within one
	// incarnation; see Task.Incarnation.
	Incarnation uint32
	Key         []byte
	Value       []byte
	// Tombstone is a Kafka record with a null value.
	Tombstone bool
	Headers   []Header
	// Time is the broker timestamp (Kafka record time, JetStream stored
	// time); delay-after is measured from it.
	Time time.Time
}

// Origin is the message's position as written in the delay-origin header:
// "kafka:topic/partition@offset" or "nats:stream#seq".
func (m *Message) Origin() string {
	switch m.Transport {
	case TransportNATS:
		return "nats:" + m.Source + "#" + strconv.FormatInt(m.Offset, 10)
	default:
		return "kafka:" + m.Source + "/" + strconv.FormatInt(int64(m.Partition), 10) + "@" + strconv.FormatInt(m.Offset, 10)
	}
}

// Rules is what a configured source allows; Parse applies them.
type Rules struct {
	// DefaultTarget is used when a message has no delay-target header.
	DefaultTarget string
	// DLQ is the dead-letter destination on the source's own transport.
	DLQ string
	// MaxDelay bounds due - source time, and with Now set due - Now too,
	// so a source time ahead of the bridge's clock (a producer's
	// CreateTime) does not stretch it; 0 means no bound.
	MaxDelay time.Duration
	// Now is the bridge's clock; nil bounds MaxDelay by source time only.
	Now func() time.Time
	// MaxBytes bounds key + value + headers (with their framing, see
	// headerFraming) as delivered; 0 means no bound.
	MaxBytes int
	// Transports reports whether a transport is configured, so that
	// "kafka:NAME" on a NATS-only bridge is a bad-target. Nil means only the
	// source's own transport.
	Transports func(Transport) bool
	// DelaySource reports whether a target is one of the bridge's delay
	// sources, which is never allowed: delivered there without its control
	// headers, a message would come back as a missing-due dead letter.
	DelaySource func(t Transport, name string) bool
	// Allow reports whether a publisher may name this target (targets.allow).
	// Nil allows every target.
	Allow func(t Transport, name string) bool
}

// Kind is what a Task asks of the engine.
type Kind uint8

// Task kinds.
const (
	// KindSchedule delivers Value to Target at Due; replaces a pending task
	// with the same (Source, ID) unless that one is newer.
	KindSchedule Kind = 1
	// KindCancel removes the pending task (Source, ID) and is remembered for
	// the cancel retention so an older schedule arriving later is dropped.
	KindCancel Kind = 2
	// KindDeadLetter delivers the message unchanged to its DLQ at once. It is
	// never indexed by id.
	KindDeadLetter Kind = 3
)

func (k Kind) String() string {
	switch k {
	case KindSchedule:
		return "schedule"
	case KindCancel:
		return "cancel"
	case KindDeadLetter:
		return "dead-letter"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// Task is one unit of durable work. Headers are stored as they will be
// delivered, so the fire path does no header work.
type Task struct {
	Kind Kind
	// ID is the task identity for replace/cancel, scoped to Source.
	ID     string
	Source string
	Origin string
	// Stamp (broker time, Unix ms), Partition, Incarnation and Offset order
	// messages with the same id: the later broker timestamp wins; in the
	// same log (same partition and incarnation) the later offset wins.
	// Incarnation 0 is the first log a source partition was read from.
	Stamp       int64
	Partition   int32
	Incarnation uint32
	Offset      int64
	// Due is the scheduled time in Unix ms, as written in delay-due. Retries
	// move the store position, never this field. A dead letter's is when it
	// was decided (Rules.Now, else the message time).
	Due int64
	// Transport and Target say where the task is delivered. For dead letters
	// this is the DLQ.
	Transport Transport
	Target    string
	Key       []byte
	Value     []byte
	Headers   []Header
	Attempts  uint32
	// DLQTransport and DLQ are where the task goes when publishing fails
	// after the retry policy is exhausted (the source's dead-letter
	// destination).
	DLQTransport Transport
	DLQ          string
	// Code and Detail explain a dead letter.
	Code   Code
	Detail string
}

// Destination is where the task is delivered, as config and logs write a
// target: "kafka:NAME" or "nats:SUBJECT" (a dead letter's: its DLQ).
func (t *Task) Destination() string { return t.Transport.String() + ":" + t.Target }

// originSize bounds len(m.Origin()): the longest prefix and two integers.
func originSize(m *Message) int {
	return len("kafka:") + len(m.Source) + len("/@") + 11 + 20
}

// appendOrigin appends Origin() to dst without allocating a string.
func (m *Message) appendOrigin(dst []byte) []byte {
	switch m.Transport {
	case TransportNATS:
		dst = append(dst, "nats:"...)
		dst = append(dst, m.Source...)
		dst = append(dst, '#')
		return strconv.AppendInt(dst, m.Offset, 10)
	default:
		dst = append(dst, "kafka:"...)
		dst = append(dst, m.Source...)
		dst = append(dst, '/')
		dst = strconv.AppendInt(dst, int64(m.Partition), 10)
		dst = append(dst, '@')
		return strconv.AppendInt(dst, m.Offset, 10)
	}
}
