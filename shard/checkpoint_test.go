package shard

import (
	"bytes"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

func TestCheckpointValueCodec(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cp      Checkpoint
		enc     []byte // nil: cp is not encoded, only enc decoded
		dec     []byte // decoded instead of enc when set
		wantOff int64
		wantFP  uint64
		wantInc uint32
		wantErr bool
	}{
		{name: "offset only is the old 8-byte form", cp: Checkpoint{Offset: 41},
			enc: []byte{0, 0, 0, 0, 0, 0, 0, 41}, wantOff: 41},
		{name: "zero offset", cp: Checkpoint{Offset: 0},
			enc: []byte{0, 0, 0, 0, 0, 0, 0, 0}, wantOff: 0},
		{name: "negative offset", cp: Checkpoint{Offset: -1},
			enc: []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, wantOff: -1},
		{name: "with fingerprint", cp: Checkpoint{Offset: 0x0102, Fingerprint: 0xdeadbeefcafef00d},
			enc: []byte{0, 0, 0, 0, 0, 0, 1, 2, 0xde, 0xad, 0xbe, 0xef, 0xca, 0xfe, 0xf0, 0x0d}, wantOff: 0x0102, wantFP: 0xdeadbeefcafef00d},
		{name: "fingerprint 1", cp: Checkpoint{Offset: 7, Fingerprint: 1},
			enc: []byte{0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1}, wantOff: 7, wantFP: 1},
		{name: "incarnation", cp: Checkpoint{Offset: 7, Fingerprint: 1, Incarnation: 0x01020304},
			enc: []byte{0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 3, 4}, wantOff: 7, wantFP: 1, wantInc: 0x01020304},
		{name: "incarnation without fingerprint", cp: Checkpoint{Offset: 7, Incarnation: 2},
			enc: []byte{0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2}, wantOff: 7, wantInc: 2},
		{name: "20 bytes with a zero incarnation is never written", dec: []byte{0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0}, wantErr: true},
		{name: "empty", dec: []byte{}, wantErr: true},
		{name: "short", dec: []byte{0, 0, 0, 0, 0, 0, 41}, wantErr: true},
		{name: "between the forms", dec: make([]byte, 12), wantErr: true},
		{name: "long", dec: make([]byte, 17), wantErr: true},
		{name: "longer", dec: make([]byte, 24), wantErr: true},
		{name: "16 bytes with a zero fingerprint is never written", dec: []byte{0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := tc.dec
			if tc.enc != nil {
				got := appendCheckpointValue([]byte("prefix"), tc.cp)
				if !bytes.Equal(got, append([]byte("prefix"), tc.enc...)) {
					t.Fatalf("encoded % x, want % x", got[len("prefix"):], tc.enc)
				}
				in = tc.enc
			}
			cp, err := decodeCheckpointValue(in)
			if (err != nil) != tc.wantErr {
				t.Fatalf("decode error %v, want error %v", err, tc.wantErr)
			}
			if want := (Checkpoint{Offset: tc.wantOff, Fingerprint: tc.wantFP, Incarnation: tc.wantInc}); err == nil && cp != want {
				t.Fatalf("decoded %+v, want %+v", cp, want)
			}
		})
	}
}

// FuzzDecodeCheckpointValue: the decoder never panics, accepts only the
// three forms, and what it accepts encodes back to the same bytes.
func FuzzDecodeCheckpointValue(f *testing.F) {
	f.Add([]byte{})
	f.Add(appendCheckpointValue(nil, Checkpoint{Offset: 41}))
	f.Add(appendCheckpointValue(nil, Checkpoint{Offset: 41, Fingerprint: 9}))
	f.Add(appendCheckpointValue(nil, Checkpoint{Offset: 41, Incarnation: 3}))
	f.Add(make([]byte, 16))
	f.Add(make([]byte, 9))
	f.Fuzz(func(t *testing.T, b []byte) {
		cp, err := decodeCheckpointValue(b)
		if err != nil {
			if len(b) == checkpointLen {
				t.Fatalf("8-byte value refused: %v", err)
			}
			return
		}
		if len(b) != checkpointLen && len(b) != checkpointFPLen && len(b) != checkpointIncLen {
			t.Fatalf("accepted %d bytes", len(b))
		}
		if enc := appendCheckpointValue(nil, cp); !bytes.Equal(enc, b) {
			t.Fatalf("decoded %+v re-encodes to % x, not % x", cp, enc, b)
		}
	})
}

// A fingerprint is stored in the ingest commit and survives a reopen; a
// checkpoint without one is stored in the old 8-byte form and reads back
// with none, and replaces a fingerprinted one.
func TestLoadCheckpointFingerprint(t *testing.T) {
	h := newHarness(t, nil)
	if _, ok, err := h.e.LoadCheckpoint("kafka|t|0"); ok || err != nil {
		t.Fatalf("fresh checkpoint: ok=%v err=%v", ok, err)
	}
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1)},
		Checkpoint{Key: "kafka|t|0", Offset: 41, Fingerprint: 0xabc},
		Checkpoint{Key: "kafka|t|1", Offset: 5, Fingerprint: 0xdef},
		Checkpoint{Key: "nats|S|c", Offset: 7},
		Checkpoint{Key: "kafka|t|2", Offset: 3, Fingerprint: 0x123, Incarnation: 4})
	h.ingest(nil, Checkpoint{Key: "kafka|t|1", Offset: 6})
	h.reopen()
	for _, want := range []Checkpoint{
		{Key: "kafka|t|0", Offset: 41, Fingerprint: 0xabc},
		{Key: "kafka|t|1", Offset: 6},
		{Key: "nats|S|c", Offset: 7},
		{Key: "kafka|t|2", Offset: 3, Fingerprint: 0x123, Incarnation: 4},
	} {
		got, ok, err := h.e.LoadCheckpoint(want.Key)
		if err != nil || !ok || got != want {
			t.Fatalf("LoadCheckpoint(%s) = %+v, %v, %v; want %+v", want.Key, got, ok, err, want)
		}
		off, ok, err := h.e.Checkpoint(want.Key)
		if err != nil || !ok || off != want.Offset {
			t.Fatalf("Checkpoint(%s) = %d, %v, %v; want %d", want.Key, off, ok, err, want.Offset)
		}
		v, found, err := getCopy(h.e.db, offsetKey(want.Key))
		wantLen := 8
		switch {
		case want.Incarnation != 0:
			wantLen = 20
		case want.Fingerprint != 0:
			wantLen = 16
		}
		if err != nil || !found || len(v) != wantLen {
			t.Fatalf("%s stored as %d bytes (found %v, %v), want %d", want.Key, len(v), found, err, wantLen)
		}
	}
}
