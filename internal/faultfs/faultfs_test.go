package faultfs

import (
	"errors"
	"testing"

	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
)

func TestFullDisk(t *testing.T) {
	for _, tc := range []struct {
		name     string
		suffixes []string
		op       errorfs.Op
		on, fail bool
	}{
		{"off", nil, errorfs.Op{Kind: errorfs.OpFileWrite, Path: "000001.log"}, false, false},
		{"any file", nil, errorfs.Op{Kind: errorfs.OpFileWrite, Path: "000001.log"}, true, true},
		{"sync", nil, errorfs.Op{Kind: errorfs.OpFileSync, Path: "MANIFEST-000001"}, true, true},
		{"reads pass", nil, errorfs.Op{Kind: errorfs.OpFileReadAt, Path: "000002.sst"}, true, false},
		{"matching suffix", []string{".sst", ".blob"}, errorfs.Op{Kind: errorfs.OpFileWriteAt, Path: "000003.blob"}, true, true},
		{"other file", []string{".sst", ".blob"}, errorfs.Op{Kind: errorfs.OpFileWrite, Path: "000001.log"}, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tg := FullDisk(tc.suffixes...)
			if tc.on {
				tg.On()
			}
			err := tg.MaybeError(tc.op)
			if got := err != nil; got != tc.fail || (got && !errors.Is(err, ErrNoSpace)) {
				t.Fatalf("MaybeError(%v %s) = %v, want failure %v", tc.op.Kind, tc.op.Path, err, tc.fail)
			}
		})
	}
}

// TestStallReads: a matching read is held from On until Release (Held
// says when it is), other files' reads and writes pass, and after Release
// nothing is held.
func TestStallReads(t *testing.T) {
	st := StallReads(".blob")
	blob := errorfs.Op{Kind: errorfs.OpFileReadAt, Path: "000004.blob"}
	if err := st.MaybeError(blob); err != nil { // off: passes at once
		t.Fatal(err)
	}
	st.On()
	for _, op := range []errorfs.Op{
		{Kind: errorfs.OpFileReadAt, Path: "000003.sst"},
		{Kind: errorfs.OpFileWrite, Path: "000004.blob"},
	} {
		if err := st.MaybeError(op); err != nil {
			t.Fatalf("MaybeError(%v %s) = %v", op.Kind, op.Path, err)
		}
	}
	select {
	case <-st.Held():
		t.Fatal("Held before any matching read")
	default:
	}
	done := make(chan error, 1)
	go func() { done <- st.MaybeError(blob) }()
	<-st.Held()
	select {
	case err := <-done:
		t.Fatalf("a read of a stalled file returned (%v) before Release", err)
	default:
	}
	st.Release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if err := st.MaybeError(blob); err != nil { // released: passes at once
		t.Fatal(err)
	}
}
