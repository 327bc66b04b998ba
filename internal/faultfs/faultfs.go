// Package faultfs holds the disk faults the store's tests inject through
// Pebble's errorfs; only tests import it.
package faultfs

import (
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/cockroachdb/pebble/v2/vfs/errorfs"
)

// ErrNoSpace is the injected write error: ENOSPC.
var ErrNoSpace = fmt.Errorf("injected: %w", syscall.ENOSPC)

// FullDisk is a switch (off until On) that fails with ErrNoSpace the
// writes and syncs of the files whose names end with one of suffixes, or
// of every file when none is given: a disk that filled up. With ".sst" and
// ".blob" the store's flushes fail while its WAL, writing into a recycled
// file, still takes commits.
func FullDisk(suffixes ...string) *errorfs.Toggle {
	return &errorfs.Toggle{Injector: errorfs.InjectorFunc(func(op errorfs.Op) error {
		if len(suffixes) > 0 && !slices.ContainsFunc(suffixes, func(s string) bool { return strings.HasSuffix(op.Path, s) }) {
			return nil
		}
		switch op.Kind {
		case errorfs.OpFileWrite, errorfs.OpFileWriteAt, errorfs.OpFileSync, errorfs.OpFileSyncData, errorfs.OpFileSyncTo:
			return ErrNoSpace
		}
		return nil
	})}
}

// Stall holds, once On, the reads of the files whose names end with one
// of its suffixes (of every file when none is given) until Release: a
// disk that stopped answering reads (a hung network volume, a throttled
// cloud disk). Held is closed when the first read is held, so a test
// knows that a reader is inside its read. One use: Release lets the held
// reads and every later one through.
type Stall struct {
	suffixes []string
	on       atomic.Bool
	held     chan struct{}
	heldOnce sync.Once
	release  chan struct{}
	relOnce  sync.Once
}

// StallReads returns a Stall (off until On) of the reads of the files
// whose names end with one of suffixes, or of every file.
func StallReads(suffixes ...string) *Stall {
	return &Stall{suffixes: suffixes, held: make(chan struct{}), release: make(chan struct{})}
}

// On starts holding reads.
func (s *Stall) On() { s.on.Store(true) }

// Held is closed once a read is held.
func (s *Stall) Held() <-chan struct{} { return s.held }

// Release lets the held reads go on and holds no more.
func (s *Stall) Release() {
	s.relOnce.Do(func() {
		s.on.Store(false)
		close(s.release)
	})
}

// String names the injector (errorfs.Injector).
func (s *Stall) String() string { return "stall-reads" }

// MaybeError holds a read of a matching file while the stall is on
// (errorfs.Injector); it never fails an operation.
func (s *Stall) MaybeError(op errorfs.Op) error {
	if !s.on.Load() || op.Kind != errorfs.OpFileRead && op.Kind != errorfs.OpFileReadAt {
		return nil
	}
	if len(s.suffixes) > 0 && !slices.ContainsFunc(s.suffixes, func(x string) bool { return strings.HasSuffix(op.Path, x) }) {
		return nil
	}
	s.heldOnce.Do(func() { close(s.held) })
	<-s.release
	return nil
}
