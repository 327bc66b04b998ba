package shard

import (
	"encoding/binary"
	"fmt"
)

// A checkpoint value is the offset, big-endian, followed by the fingerprint
// of the message at that offset when the source gave one, and the
// incarnation of the log when it is not the first:
//
//	offset i64                                  (8 bytes: no fingerprint;
//	                                             every value written before
//	                                             fingerprints existed)
//	offset i64 | fingerprint u64                (16 bytes)
//	offset i64 | fingerprint u64 | incarn. u32  (20 bytes; fingerprint may be 0)
//
// Zero fields are left out where the form allows, so sources that do not
// fingerprint (NATS) of a first log write exactly what they wrote before,
// and a release before incarnations reads what this one writes for a
// first log.
const (
	checkpointLen    = 8
	checkpointFPLen  = 16
	checkpointIncLen = 20
)

// appendCheckpointValue appends the stored form of cp's offset,
// fingerprint and incarnation to dst.
func appendCheckpointValue(dst []byte, cp Checkpoint) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(cp.Offset))
	if cp.Fingerprint != 0 || cp.Incarnation != 0 {
		dst = binary.BigEndian.AppendUint64(dst, cp.Fingerprint)
	}
	if cp.Incarnation != 0 {
		dst = binary.BigEndian.AppendUint32(dst, cp.Incarnation)
	}
	return dst
}

// decodeCheckpointValue reads a value written by appendCheckpointValue
// into a Checkpoint without Key.
func decodeCheckpointValue(v []byte) (Checkpoint, error) {
	var cp Checkpoint
	switch len(v) {
	case checkpointLen:
	case checkpointFPLen:
		if cp.Fingerprint = binary.BigEndian.Uint64(v[8:]); cp.Fingerprint == 0 {
			// Never written: a zero fingerprint takes the short form.
			return Checkpoint{}, fmt.Errorf("corrupt value: 16 bytes with a zero fingerprint")
		}
	case checkpointIncLen:
		cp.Fingerprint = binary.BigEndian.Uint64(v[8:])
		if cp.Incarnation = binary.BigEndian.Uint32(v[16:]); cp.Incarnation == 0 {
			return Checkpoint{}, fmt.Errorf("corrupt value: 20 bytes with a zero incarnation")
		}
	default:
		return Checkpoint{}, fmt.Errorf("corrupt value of %d bytes", len(v))
	}
	cp.Offset = int64(binary.BigEndian.Uint64(v))
	return cp, nil
}

// LoadCheckpoint returns the checkpoint stored for key by Ingest, with its
// Fingerprint (0 when none was stored).
func (e *Engine) LoadCheckpoint(key string) (cp Checkpoint, ok bool, err error) {
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	if e.closed {
		return Checkpoint{}, false, ErrClosed
	}
	v, found, err := getCopy(e.db, offsetKey(key))
	if err != nil {
		return Checkpoint{}, false, fmt.Errorf("shard: checkpoint %q: %w", key, err)
	}
	if !found {
		return Checkpoint{}, false, nil
	}
	cp, err = decodeCheckpointValue(v)
	if err != nil {
		return Checkpoint{}, false, fmt.Errorf("shard: checkpoint %q: %w", key, err)
	}
	cp.Key = key
	return cp, true, nil
}
