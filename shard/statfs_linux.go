//go:build linux

package shard

import (
	"fmt"
	"io/fs"
	"syscall"
)

// statVolume reads the free space of the volume holding dir (statfs):
// what an unprivileged process may use (f_bavail), as df shows it.
func statVolume(dir string) (volumeStats, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return volumeStats{}, fmt.Errorf("statfs %s: %w", dir, err)
	}
	unit := uint64(st.Frsize)
	if unit == 0 {
		unit = uint64(st.Bsize)
	}
	return volumeStats{
		Free:       st.Bavail * unit,
		Size:       st.Blocks * unit,
		FreeInodes: st.Ffree,
		Inodes:     st.Files,
	}, nil
}

// allocatedBytes is the space a file takes on its volume (st_blocks), as
// du counts it: a write-ahead log Pebble preallocated takes its full size
// while its length is what was written so far.
func allocatedBytes(fi fs.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Blocks) * 512
	}
	return uint64(max(fi.Size(), 0))
}
