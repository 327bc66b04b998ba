package kafka

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/cespare/xxhash/v2"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// The store checkpoint of a partition is keyed by topic and partition only,
// and kafka-go speaks Metadata up to v8, which has no topic IDs. A topic
// deleted and created again (or the same name on another cluster, with the
// data dir kept) numbers its records from 0 again, so an offset alone would
// make the source skip the new log's records up to the old position. The
// checkpoint therefore carries a fingerprint of the record at its offset,
// and a partition worker checks it before it reads: the record at that
// offset must still be the one checkpointed.

// fingerprint identifies a record of a partition: xxhash64 of its
// timestamp, key, value and headers, each length-prefixed and a null key
// or value told from an empty one. untimed marks a record without a
// timestamp, whose Time the decoder replaced with the fetch time; it hashes
// as -1 so a second read gives the same fingerprint. Never 0, which means
// "none" in a shard.Checkpoint.
func fingerprint(m *codec.Message, untimed bool) uint64 {
	var d xxhash.Digest
	d.Reset()
	var buf [8]byte
	num := func(n int64) {
		binary.BigEndian.PutUint64(buf[:], uint64(n))
		_, _ = d.Write(buf[:])
	}
	bytes := func(b []byte, null bool) {
		if null {
			num(-1)
			return
		}
		num(int64(len(b)))
		_, _ = d.Write(b)
	}
	ts := m.Time.UnixMilli()
	if untimed {
		ts = -1
	}
	num(ts)
	bytes(m.Key, m.Key == nil)
	bytes(m.Value, m.Tombstone)
	num(int64(len(m.Headers)))
	for _, h := range m.Headers {
		num(int64(len(h.Key)))
		_, _ = d.WriteString(h.Key)
		bytes(h.Value, h.Value == nil)
	}
	if fp := d.Sum64(); fp != 0 {
		return fp
	}
	return 1
}

// loadCheckpoint reads the stored checkpoint of key with its fingerprint
// when the handler keeps one (bridge.CheckpointLoader), else without.
func loadCheckpoint(h bridge.Handler, key string) (shard.Checkpoint, bool, error) {
	if l, ok := h.(bridge.CheckpointLoader); ok {
		return l.LoadCheckpoint(key)
	}
	off, ok, err := h.Checkpoint(key)
	return shard.Checkpoint{Key: key, Offset: off}, ok, err
}

// identity is what a partition's log says of a stored checkpoint.
type identity int

const (
	// identityUnknown: no fingerprint stored, or retention deleted the
	// checkpointed record (its offset is below the log start).
	identityUnknown identity = iota
	// identitySame: the record at the checkpointed offset is the one the
	// checkpoint was taken from.
	identitySame
	// identityOther: another log: a different record at the offset, or
	// none where the old log had one (the log ends before or at it).
	identityOther
	// identityPending: the log reaches past the offset, but the record
	// there is not readable yet: a high watermark that trails after a
	// leader change, or an open transaction. Check again later; neither
	// reading on (a new log's records up to the offset would be skipped)
	// nor reading the log again (every retained schedule would fire
	// twice) is safe before the record can be compared.
	identityPending
)

// logCheck is the outcome of checkIdentity.
type logCheck struct {
	verdict identity
	reason  string
	// first and end are the log start and end (high watermark) as listed;
	// -1 when not listed (no fingerprint to check).
	first, end int64
}

// checkIdentity fetches the record at cp.Offset and compares it with
// cp.Fingerprint. It costs a ListOffsets and one Fetch (long polls for up
// to IdentityWait in the rare case that the readable log ends at
// cp.Offset, then one Fetch at cp.Offset+1) and runs when a partition
// worker starts, and after a failed fetch, not per batch.
//
// Kafka answers a fetch past the log end offset with OffsetOutOfRange,
// and one at or past the high watermark (the last stable offset under
// read_committed) but within the log with nothing. So when cp.Offset
// stays unreadable, a fetch at cp.Offset+1 tells a log that ends exactly
// at cp.Offset (out of range: the checkpointed record is not there, so
// another log) from one that holds records there not readable yet
// (identityPending).
func (s *Source) checkIdentity(ctx context.Context, topic string, partition int, cp shard.Checkpoint) (logCheck, error) {
	if cp.Fingerprint == 0 {
		return logCheck{verdict: identityUnknown, reason: "no fingerprint stored", first: -1, end: -1}, nil
	}
	deadline := time.Now().Add(s.cfg.IdentityWait)
	for {
		first, end, err := s.logRange(ctx, topic, partition)
		if err != nil {
			return logCheck{}, err
		}
		c := logCheck{first: first, end: end}
		if cp.Offset < first {
			c.verdict, c.reason = identityUnknown, "retention deleted the checkpointed record"
			return c, nil
		}
		notes := decodeNotes{probe: true, probeAt: cp.Offset}
		items, next, _, err := fetchItems(ctx, s.client, &s.cfg, topic, partition, cp.Offset, s.cfg.MaxWait, probeFetchBytes(&s.cfg), nil, nil, &notes)
		switch {
		case errors.Is(err, kafkago.OffsetOutOfRange):
			// Past the log end, or retention moved the start past it
			// since the listing: list again to tell which.
			if c.first, c.end, err = s.logRange(ctx, topic, partition); err != nil {
				return logCheck{}, err
			}
			if cp.Offset < c.first {
				c.verdict, c.reason = identityUnknown, "retention deleted the checkpointed record"
				return c, nil
			}
			if c.end > cp.Offset {
				// The listing says the log holds the offset: the answer
				// was transient (a leader moving); check again.
				return logCheck{}, fmt.Errorf("fetch the checkpointed record at %d: out of range, but the log spans [%d, %d)", cp.Offset, c.first, c.end)
			}
			c.verdict, c.reason = identityOther, "the log ends before the checkpointed offset"
			return c, nil
		case err != nil:
			return logCheck{}, fmt.Errorf("fetch the checkpointed record at %d: %w", cp.Offset, err)
		case len(items) > 0 && items[0].Msg.Offset == cp.Offset:
			if fingerprint(&items[0].Msg, notes.untimedAt(cp.Offset)) == cp.Fingerprint {
				c.verdict, c.reason = identitySame, "same record at the checkpointed offset"
			} else {
				c.verdict, c.reason = identityOther, "a different record at the checkpointed offset"
			}
			return c, nil
		case notes.atControl || notes.atAborted:
			// The checkpointed record was a data record of the log or of
			// a committed transaction (read_committed reads no other), and
			// in one log an offset keeps its record until compaction or
			// retention removes it. A marker or an aborted record there
			// is another log's.
			c.verdict = identityOther
			c.reason = "a transaction marker at the checkpointed offset, where the log read had a data record"
			if notes.atAborted {
				c.reason = "a record of an aborted transaction at the checkpointed offset, where the log read had a committed one"
			}
			return c, nil
		case len(items) > 0 || next > cp.Offset:
			// The checkpointed record was a committed data record; here
			// the offset holds nothing any more: compaction removed it (a
			// delay topic keyed by id is a natural candidate for
			// cleanup.policy=compact) or emptied its batch. Taking that for
			// another log would read the whole log again and fire every
			// retained schedule twice: resume after the offset, as without
			// a fingerprint.
			c.verdict, c.reason = identityUnknown, "no record at the checkpointed offset any more (compacted away?)"
			return c, nil
		case time.Now().Before(deadline):
			continue // nothing readable at the offset yet
		default:
			return s.probePastOffset(ctx, topic, partition, cp, c)
		}
	}
}

// probePastOffset decides on a checkpointed offset that stayed unreadable:
// a fetch at the next offset is out of range only if the log ends exactly
// at cp.Offset.
func (s *Source) probePastOffset(ctx context.Context, topic string, partition int, cp shard.Checkpoint, c logCheck) (logCheck, error) {
	var notes decodeNotes
	_, _, _, err := fetchItems(ctx, s.client, &s.cfg, topic, partition, cp.Offset+1, s.cfg.MaxWait, probeFetchBytes(&s.cfg), nil, nil, &notes)
	switch {
	case errors.Is(err, kafkago.OffsetOutOfRange):
		if c.first, c.end, err = s.logRange(ctx, topic, partition); err != nil {
			return logCheck{}, err
		}
		if cp.Offset < c.first {
			c.verdict, c.reason = identityUnknown, "retention deleted the checkpointed record"
			return c, nil
		}
		if c.end > cp.Offset {
			return logCheck{}, fmt.Errorf("fetch past the checkpointed offset %d: out of range, but the log spans [%d, %d)", cp.Offset, c.first, c.end)
		}
		c.verdict, c.reason = identityOther, "the log ends at the checkpointed offset"
		return c, nil
	case err != nil:
		return logCheck{}, fmt.Errorf("fetch past the checkpointed offset %d: %w", cp.Offset, err)
	default:
		c.verdict, c.reason = identityPending, "the log reaches past the checkpointed offset, whose record is not readable yet (a trailing high watermark or an open transaction)"
		return c, nil
	}
}

// logRange lists the log start and end (high watermark) of a partition.
func (s *Source) logRange(ctx context.Context, topic string, partition int) (first, end int64, err error) {
	resp, err := s.client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{
		Topics: map[string][]kafkago.OffsetRequest{topic: {
			kafkago.FirstOffsetOf(partition), kafkago.LastOffsetOf(partition),
		}},
	})
	if err != nil {
		return -1, -1, fmt.Errorf("list offsets %s/%d: %w", topic, partition, err)
	}
	first, end = -1, -1
	for _, p := range resp.Topics[topic] {
		if p.Partition != partition {
			continue
		}
		if p.Error != nil {
			return -1, -1, fmt.Errorf("list offsets %s/%d: %w", topic, partition, p.Error)
		}
		if p.FirstOffset >= 0 {
			first = p.FirstOffset
		}
		if p.LastOffset >= 0 {
			end = p.LastOffset
		}
	}
	if first < 0 || end < 0 {
		return -1, -1, fmt.Errorf("list offsets %s/%d: log start or end missing from the answer", topic, partition)
	}
	return first, end, nil
}
