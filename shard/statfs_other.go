//go:build !linux

package shard

import (
	"errors"
	"io/fs"
)

// statVolume is not implemented off Linux: no disk metrics, no reserve.
func statVolume(string) (volumeStats, error) {
	return volumeStats{}, errors.ErrUnsupported
}

// allocatedBytes is the file's length off Linux.
func allocatedBytes(fi fs.FileInfo) uint64 { return uint64(max(fi.Size(), 0)) }
