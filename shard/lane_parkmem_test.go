package shard

import (
	"strings"
	"testing"
	"unsafe"

	"github.com/delaybridge/delaybridge/codec"
)

// TestParkedTaskDoesNotPinDecodedStrings: a task set aside while its lane
// is stuck or its transport is in an outage keeps its fire time, seq, due
// and source only (lane.go), a few dozen bytes, so that a herd of due tasks
// claimed while the lane waits costs little. DecodeTask puts all of a
// task's strings (id, source, target, origin, DLQ, key...) in one
// allocation; a parked source that is a substring of it keeps the whole
// block alive: with a long id, kilobytes per parked task. Hunt H153 saw
// 34-40 MB of such blocks (96 B each) in the live heap while a 500 k herd
// was set aside in front of a NATS target that was down.
func TestParkedTaskDoesNotPinDecodedStrings(t *testing.T) {
	task := sched(strings.Repeat("i", 4096), t0, 1)
	var got codec.Task
	if err := codec.DecodeTask(codec.AppendTask(nil, &task), &got); err != nil {
		t.Fatal(err)
	}
	// The decoded strings share one block: find its extent from the
	// strings the task holds.
	lo, hi := uintptr(0), uintptr(0)
	for _, s := range []string{got.ID, got.Source, got.Target, got.Origin, got.DLQ} {
		if s == "" {
			continue
		}
		p := uintptr(unsafe.Pointer(unsafe.StringData(s)))
		if lo == 0 || p < lo {
			lo = p
		}
		if e := p + uintptr(len(s)); e > hi {
			hi = e
		}
	}
	p := parkedOf(fireItem{fire: got.Due, seq: 7, task: &got})
	if p.source != got.Source {
		t.Fatalf("parked source %q, want %q", p.source, got.Source)
	}
	if sp := uintptr(unsafe.Pointer(unsafe.StringData(p.source))); sp >= lo && sp < hi {
		t.Fatalf("the parked task's source shares the decoded task's string block (%d bytes, a %d-byte id in it): "+
			"each task set aside keeps its whole decoded strings alive", hi-lo, len(got.ID))
	}
}
