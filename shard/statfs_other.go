//go:build !linux

package shard

import "errors"

// statVolume is not implemented off Linux: no disk metrics, no reserve.
func statVolume(string) (volumeStats, error) {
	return volumeStats{}, errors.ErrUnsupported
}
