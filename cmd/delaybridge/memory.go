package main

import (
	"math"
	"os"
	"runtime/debug"

	"go.uber.org/zap"
)

// memoryWarning says what is wrong with the Go memory limit (GOMEMLIMIT,
// math.MaxInt64 when unset) for a store cache of cacheMB in a container
// limited to container bytes (0: no limit known), or "".
//
// Where the cache is Go heap (inGoHeap: a build without cgo, like the
// release image) the GC's goal counts it: with no limit the heap may grow
// to twice its live size, a limit under the cache plus a working set makes
// the GC run back to back once the cache fills, and a limit over the
// container's leaves the kernel to kill the process before the GC works
// hard. Built with cgo, Pebble allocates the cache outside the Go heap:
// the limit and the cache together must fit the container.
func memoryWarning(inGoHeap bool, limit int64, cacheMB int, container int64) string {
	cache := int64(cacheMB) << 20
	set := limit != math.MaxInt64
	switch {
	case inGoHeap && !set:
		return "the store's cache is Go heap in this build (no cgo) and GOMEMLIMIT is not set: the heap may grow to twice its live size; set GOMEMLIMIT to about 90% of the memory the process may use"
	case inGoHeap && limit < cache+128<<20:
		return "GOMEMLIMIT leaves less than 128 MiB beside the store's cache, which is Go heap in this build (no cgo): once the cache fills, the GC will run back to back; raise GOMEMLIMIT or lower store.cache_mb"
	case inGoHeap && container > 0 && limit >= container:
		return "GOMEMLIMIT is not below the container's memory limit: the kernel would kill the process before the GC works hard; set it to about 90% of the container's limit"
	case !inGoHeap && set && container > 0 && limit+cache > container:
		return "GOMEMLIMIT plus the store's cache (outside the Go heap in this build, with cgo) exceed the container's memory limit: set GOMEMLIMIT to about 90% of what the cache leaves"
	}
	return ""
}

// logMemory logs where the store's cache lives, the Go memory limit and
// the container's, at Warn when memoryWarning finds fault with them.
func logMemory(log *zap.Logger, cacheMB int) {
	limit := debug.SetMemoryLimit(-1)
	var container int64
	if b, err := os.ReadFile("/proc/self/cgroup"); err == nil {
		container = containerMemoryLimit(os.DirFS("/"), string(b))
	}
	fields := []zap.Field{zap.Int("cache_mb", cacheMB), zap.Bool("cache_in_go_heap", cacheInGoHeap)}
	if limit != math.MaxInt64 {
		fields = append(fields, zap.Int64("gomemlimit_bytes", limit))
	}
	if container > 0 {
		fields = append(fields, zap.Int64("container_memory_limit_bytes", container))
	}
	if w := memoryWarning(cacheInGoHeap, limit, cacheMB, container); w != "" {
		log.Warn(w, fields...)
		return
	}
	log.Info("memory", fields...)
}
