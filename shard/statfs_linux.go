//go:build linux

package shard

import (
	"fmt"
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
