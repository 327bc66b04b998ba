//go:build linux

package benchrun

import (
	"syscall"
	"time"
)

// freshPageMicros writes one byte to each 4 KiB page of a new 64 MiB
// anonymous mapping and returns the mean time per page: what a process
// pays for memory the kernel has not handed it before (a minor page
// fault and the zeroing of the page). Well under 1 µs on bare metal; on
// some VMs over 10 µs, when every fresh guest page is a fault in the host
// too. 0 when the mapping fails.
func freshPageMicros() float64 {
	const size, page = 64 << 20, 4 << 10
	b, err := syscall.Mmap(-1, 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	if err != nil {
		return 0
	}
	defer func() { _ = syscall.Munmap(b) }()
	// 4 KiB pages even where transparent huge pages are "always": a 2 MiB
	// fault per 512 writes would understate the cost per page.
	_ = syscall.Madvise(b, syscall.MADV_NOHUGEPAGE)
	start := time.Now()
	for i := 0; i < size; i += page {
		b[i] = 1
	}
	return float64(time.Since(start).Nanoseconds()) / 1e3 / (size / page)
}
