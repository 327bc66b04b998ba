package codec

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"strings"
)

// Envelope errors; decoding wraps one of them so callers can tell a torn or
// rotten record (ErrCorrupt) from one written by a newer release
// (ErrVersion).
var (
	ErrCorrupt = errors.New("codec: corrupt envelope")
	ErrVersion = errors.New("codec: unknown envelope version")
)

// EnvelopeVersion is the first byte of the envelopes this release writes:
// EnvelopeVersion2 when the task's Incarnation is not 0 (it carries that
// field), else EnvelopeVersion, byte for byte what releases before
// incarnations wrote, so they can still read it. Both are decoded.
const (
	EnvelopeVersion  = 1
	EnvelopeVersion2 = 2
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Envelope v1 layout. Integers are varints (zigzag for signed fields),
// strings are uvarint length + bytes, and byte slices are uvarint (length+1)
// + bytes with 0 meaning nil, because Kafka distinguishes a null key or
// header value from an empty one. The header count is also written +1 so a
// nil header list survives a round trip.
//
//	version  byte (1)
//	kind, transport, dlq transport  byte each
//	attempts uvarint
//	stamp, partition, offset, due  varint
//	incarnation  uvarint (version 2 only; version 1 means 0)
//	id, source, origin, target, dlq, code, detail  string
//	key, value  bytes
//	headers  uvarint count+1, then per header: key string, value bytes
//	crc32c   4 bytes big-endian over everything before it
//
// There is no outer length: the store keeps each envelope as one value, and
// a decoder that ends anywhere but exactly at the checksum refuses the
// record, so trailing garbage is caught like any other corruption.

// AppendTask appends the envelope of t to dst and returns the extended
// slice.
func AppendTask(dst []byte, t *Task) []byte {
	dst = grow(dst, envelopeSize(t))
	start := len(dst)
	version := byte(EnvelopeVersion)
	if t.Incarnation != 0 {
		version = EnvelopeVersion2
	}
	dst = append(dst, version, byte(t.Kind), byte(t.Transport), byte(t.DLQTransport))
	dst = binary.AppendUvarint(dst, uint64(t.Attempts))
	dst = binary.AppendVarint(dst, t.Stamp)
	dst = binary.AppendVarint(dst, int64(t.Partition))
	dst = binary.AppendVarint(dst, t.Offset)
	dst = binary.AppendVarint(dst, t.Due)
	if t.Incarnation != 0 {
		dst = binary.AppendUvarint(dst, uint64(t.Incarnation))
	}
	dst = appendString(dst, t.ID)
	dst = appendString(dst, t.Source)
	dst = appendString(dst, t.Origin)
	dst = appendString(dst, t.Target)
	dst = appendString(dst, t.DLQ)
	dst = appendString(dst, string(t.Code))
	dst = appendString(dst, t.Detail)
	dst = appendBytes(dst, t.Key)
	dst = appendBytes(dst, t.Value)
	if t.Headers == nil {
		dst = append(dst, 0)
	} else {
		dst = binary.AppendUvarint(dst, uint64(len(t.Headers))+1)
		for _, h := range t.Headers {
			dst = appendString(dst, h.Key)
			dst = appendBytes(dst, h.Value)
		}
	}
	return binary.BigEndian.AppendUint32(dst, crc32.Checksum(dst[start:], castagnoli))
}

// envelopeSize is an upper bound of the encoded size, so AppendTask grows
// dst at most once.
func envelopeSize(t *Task) int {
	n := 4 + 3*binary.MaxVarintLen64 + 5 + 4*binary.MaxVarintLen64 + 4
	n += 7*binary.MaxVarintLen64 + len(t.ID) + len(t.Source) + len(t.Origin) + len(t.Target) + len(t.DLQ) + len(t.Code) + len(t.Detail)
	n += 2*binary.MaxVarintLen64 + len(t.Key) + len(t.Value)
	for _, h := range t.Headers {
		n += 2*binary.MaxVarintLen64 + len(h.Key) + len(h.Value)
	}
	return n
}

// grow makes room for n more bytes with at most one allocation, at least
// doubling the capacity, so appending many envelopes to one buffer stays
// linear.
func grow(b []byte, n int) []byte {
	if cap(b)-len(b) >= n {
		return b
	}
	nb := make([]byte, len(b), max(len(b)+n, 2*cap(b)))
	copy(nb, b)
	return nb
}

func appendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

func appendBytes(dst []byte, b []byte) []byte {
	if b == nil {
		return append(dst, 0)
	}
	dst = binary.AppendUvarint(dst, uint64(len(b))+1)
	return append(dst, b...)
}

// DecodeTask decodes an envelope written by AppendTask into t, overwriting
// every field. It copies: the decoded strings and byte slices never alias b,
// so b may be a Pebble value that is only valid until the iterator moves.
// The copies share two allocations (one for all strings, one for all byte
// slices), so a decoded task is cheap to keep. On error t is unchanged and
// the error wraps ErrCorrupt or ErrVersion.
func DecodeTask(b []byte, t *Task) error {
	if len(b) == 0 {
		return fmt.Errorf("%w: empty", ErrCorrupt)
	}
	if b[0] != EnvelopeVersion && b[0] != EnvelopeVersion2 {
		return fmt.Errorf("%w: %d", ErrVersion, b[0])
	}
	if len(b) < 5 {
		return fmt.Errorf("%w: %d bytes is too short", ErrCorrupt, len(b))
	}
	body := b[:len(b)-4]
	if got, want := crc32.Checksum(body, castagnoli), binary.BigEndian.Uint32(b[len(b)-4:]); got != want {
		return fmt.Errorf("%w: checksum %08x, want %08x", ErrCorrupt, got, want)
	}
	// Two passes over the body: the first validates it and sizes the
	// copies, the second fills them.
	var d decoder
	var tmp Task
	d.measure = true
	if err := d.decode(body, &tmp); err != nil {
		return err
	}
	d.measure = false
	d.sb.Grow(d.strLen)
	d.arena = make([]byte, 0, d.byteLen)
	// With no headers this does not allocate, and it keeps an empty (not
	// nil) header list empty.
	d.headers = make([]Header, 0, d.nHeaders)
	if err := d.decode(body, &tmp); err != nil {
		return err // unreachable: the first pass accepted the same bytes
	}
	*t = tmp
	return nil
}

type decoder struct {
	b   []byte
	off int

	measure  bool
	strLen   int
	byteLen  int
	nHeaders int

	sb      strings.Builder
	arena   []byte
	headers []Header
}

func (d *decoder) decode(body []byte, t *Task) error {
	d.b, d.off = body, 1 // the version byte was checked by the caller
	version := body[0]
	kind, err := d.byte()
	if err != nil {
		return err
	}
	if kind < byte(KindSchedule) || kind > byte(KindDeadLetter) {
		return fmt.Errorf("%w: kind %d", ErrCorrupt, kind)
	}
	t.Kind = Kind(kind)
	if t.Transport, err = d.transport(); err != nil {
		return err
	}
	if t.DLQTransport, err = d.transport(); err != nil {
		return err
	}
	attempts, err := d.uvarint()
	if err != nil {
		return err
	}
	if attempts > math.MaxUint32 {
		return fmt.Errorf("%w: attempts %d", ErrCorrupt, attempts)
	}
	t.Attempts = uint32(attempts)
	if t.Stamp, err = d.varint(); err != nil {
		return err
	}
	partition, err := d.varint()
	if err != nil {
		return err
	}
	if partition < math.MinInt32 || partition > math.MaxInt32 {
		return fmt.Errorf("%w: partition %d", ErrCorrupt, partition)
	}
	t.Partition = int32(partition)
	if t.Offset, err = d.varint(); err != nil {
		return err
	}
	if t.Due, err = d.varint(); err != nil {
		return err
	}
	t.Incarnation = 0
	if version == EnvelopeVersion2 {
		inc, err := d.uvarint()
		if err != nil {
			return err
		}
		if inc == 0 || inc > math.MaxUint32 {
			// 0 is written as version 1: a version 2 envelope with it
			// was not written by AppendTask.
			return fmt.Errorf("%w: incarnation %d", ErrCorrupt, inc)
		}
		t.Incarnation = uint32(inc)
	}
	for _, s := range [...]*string{&t.ID, &t.Source, &t.Origin, &t.Target, &t.DLQ, (*string)(&t.Code), &t.Detail} {
		if *s, err = d.string(); err != nil {
			return err
		}
	}
	if t.Key, err = d.bytes(); err != nil {
		return err
	}
	if t.Value, err = d.bytes(); err != nil {
		return err
	}
	n, err := d.uvarint()
	if err != nil {
		return err
	}
	t.Headers = nil
	if n > 0 {
		n--
		// Every header takes at least two bytes; refusing larger counts
		// up front keeps garbage from sizing a huge allocation.
		if n > uint64(len(d.b)-d.off)/2 {
			return fmt.Errorf("%w: %d headers in %d bytes", ErrCorrupt, n, len(d.b)-d.off)
		}
		if d.measure {
			d.nHeaders = int(n)
		} else {
			t.Headers = d.headers[:0:n]
		}
		for range n {
			var h Header
			if h.Key, err = d.string(); err != nil {
				return err
			}
			if h.Value, err = d.bytes(); err != nil {
				return err
			}
			if !d.measure {
				t.Headers = append(t.Headers, h)
			}
		}
	}
	if d.off != len(d.b) {
		return fmt.Errorf("%w: %d unread bytes", ErrCorrupt, len(d.b)-d.off)
	}
	return nil
}

var errTruncated = fmt.Errorf("%w: truncated", ErrCorrupt)

func (d *decoder) byte() (byte, error) {
	if d.off >= len(d.b) {
		return 0, errTruncated
	}
	c := d.b[d.off]
	d.off++
	return c, nil
}

func (d *decoder) transport() (Transport, error) {
	c, err := d.byte()
	if err != nil {
		return 0, err
	}
	// Zero is kept: a task may legitimately have no DLQ transport.
	if c > byte(TransportNATS) {
		return 0, fmt.Errorf("%w: transport %d", ErrCorrupt, c)
	}
	return Transport(c), nil
}

func (d *decoder) uvarint() (uint64, error) {
	v, n := binary.Uvarint(d.b[d.off:])
	if err := d.checkVarint(n); err != nil {
		return 0, err
	}
	d.off += n
	return v, nil
}

func (d *decoder) varint() (int64, error) {
	v, n := binary.Varint(d.b[d.off:])
	if err := d.checkVarint(n); err != nil {
		return 0, err
	}
	d.off += n
	return v, nil
}

// checkVarint refuses a varint of n bytes at d.off that did not decode, or
// that is not the shortest form (a last byte of 0 after the first): the
// encoder never writes one, so each task has exactly one envelope.
func (d *decoder) checkVarint(n int) error {
	if n <= 0 {
		return fmt.Errorf("%w: bad varint at %d", ErrCorrupt, d.off)
	}
	if n > 1 && d.b[d.off+n-1] == 0 {
		return fmt.Errorf("%w: varint at %d not in its shortest form", ErrCorrupt, d.off)
	}
	return nil
}

// span returns the next n bytes.
func (d *decoder) span(n uint64) ([]byte, error) {
	if n > uint64(len(d.b)-d.off) {
		return nil, fmt.Errorf("%w: length %d at %d overruns the record", ErrCorrupt, n, d.off)
	}
	p := d.b[d.off : d.off+int(n)]
	d.off += int(n)
	return p, nil
}

func (d *decoder) string() (string, error) {
	n, err := d.uvarint()
	if err != nil {
		return "", err
	}
	p, err := d.span(n)
	if err != nil {
		return "", err
	}
	if d.measure {
		d.strLen += len(p)
		return "", nil
	}
	if len(p) == 0 {
		return "", nil
	}
	// The builder was grown to hold every string, so it never reallocates
	// and the strings handed out earlier stay valid.
	start := d.sb.Len()
	d.sb.Write(p)
	return d.sb.String()[start:], nil
}

func (d *decoder) bytes() ([]byte, error) {
	n, err := d.uvarint()
	if err != nil {
		return nil, err
	}
	if n == 0 {
		return nil, nil
	}
	p, err := d.span(n - 1)
	if err != nil {
		return nil, err
	}
	if d.measure {
		d.byteLen += len(p)
		return p, nil
	}
	start := len(d.arena)
	d.arena = append(d.arena, p...)
	// Full slice expression: an append by the caller must not overwrite
	// the next field in the shared arena.
	return d.arena[start:len(d.arena):len(d.arena)], nil
}
