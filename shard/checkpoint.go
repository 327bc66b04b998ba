package shard

import (
	"encoding/binary"
	"fmt"
)

// A checkpoint value is the offset, big-endian, followed by the fingerprint
// of the message at that offset when the source gave one:
//
//	offset i64                   (8 bytes: no fingerprint; every value
//	                              written before fingerprints existed)
//	offset i64 | fingerprint u64 (16 bytes)
//
// A zero Fingerprint is written as the 8-byte form, so sources that do not
// fingerprint (NATS) keep writing exactly what they wrote before.
const (
	checkpointLen   = 8
	checkpointFPLen = 16
)

// appendCheckpointValue appends the stored form of cp's offset and
// fingerprint to dst.
func appendCheckpointValue(dst []byte, cp Checkpoint) []byte {
	dst = binary.BigEndian.AppendUint64(dst, uint64(cp.Offset))
	if cp.Fingerprint != 0 {
		dst = binary.BigEndian.AppendUint64(dst, cp.Fingerprint)
	}
	return dst
}

// decodeCheckpointValue reads a value written by appendCheckpointValue.
// fingerprint is 0 for the 8-byte form.
func decodeCheckpointValue(v []byte) (offset int64, fingerprint uint64, err error) {
	switch len(v) {
	case checkpointLen:
		return int64(binary.BigEndian.Uint64(v)), 0, nil
	case checkpointFPLen:
		fp := binary.BigEndian.Uint64(v[8:])
		if fp == 0 {
			// Never written: a zero fingerprint takes the short form.
			return 0, 0, fmt.Errorf("corrupt value: 16 bytes with a zero fingerprint")
		}
		return int64(binary.BigEndian.Uint64(v)), fp, nil
	default:
		return 0, 0, fmt.Errorf("corrupt value of %d bytes", len(v))
	}
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
	off, fp, err := decodeCheckpointValue(v)
	if err != nil {
		return Checkpoint{}, false, fmt.Errorf("shard: checkpoint %q: %w", key, err)
	}
	return Checkpoint{Key: key, Offset: off, Fingerprint: fp}, true, nil
}
