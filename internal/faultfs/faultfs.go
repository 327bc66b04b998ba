// Package faultfs holds the disk faults the store's tests inject through
// Pebble's errorfs; only tests import it.
package faultfs

import (
	"fmt"
	"slices"
	"strings"
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
