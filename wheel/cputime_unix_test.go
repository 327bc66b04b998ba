//go:build unix

package wheel

import (
	"syscall"
	"time"
)

// cpuTime is the process's user+system CPU time. Benchmarks report it per op
// next to wall time because the build machines are shared: wall time there
// includes time spent waiting for a core.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
