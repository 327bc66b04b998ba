//go:build linux

package shard

import "testing"

// TestStatVolume: statfs of a real directory gives plausible numbers.
func TestStatVolume(t *testing.T) {
	st, err := statVolume(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if st.Free == 0 || st.Size < st.Free || st.Inodes < st.FreeInodes {
		t.Fatalf("statVolume = %+v: want 0 < free <= size, free inodes <= inodes", st)
	}
	if _, err := statVolume(t.TempDir() + "/missing"); err == nil {
		t.Fatal("statVolume of a missing directory: no error")
	}
}
