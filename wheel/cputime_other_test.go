//go:build !unix

package wheel

import "time"

// cpuTime is not measured here; the cpu-ns/op metric then reads 0.
func cpuTime() time.Duration { return 0 }
