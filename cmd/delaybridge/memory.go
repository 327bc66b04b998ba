package main

import (
	"math"
	"runtime/debug"

	"go.uber.org/zap"
)

// memoryWarning says what is wrong with the Go memory limit (GOMEMLIMIT,
// math.MaxInt64 when unset) for a store cache of cacheMB, or "". Where
// the cache is Go heap (cacheInGoHeap: a build without cgo, like the
// release image) the GC's goal counts it: with no limit the heap may grow
// to twice its live size, and a limit under the cache plus a working set
// makes the GC run back to back once the cache fills. Built with cgo,
// Pebble allocates the cache outside the Go heap and any limit is the
// operator's choice.
func memoryWarning(inGoHeap bool, limit int64, cacheMB int) string {
	switch {
	case !inGoHeap:
		return ""
	case limit == math.MaxInt64:
		return "the store's cache is Go heap in this build (no cgo) and GOMEMLIMIT is not set: the heap may grow to twice its live size; set GOMEMLIMIT to about 90% of the memory the process may use"
	case limit < int64(cacheMB)<<20+128<<20:
		return "GOMEMLIMIT leaves less than 128 MiB beside the store's cache, which is Go heap in this build (no cgo): once the cache fills, the GC will run back to back; raise GOMEMLIMIT or lower store.cache_mb"
	}
	return ""
}

// logMemory logs where the store's cache lives and the Go memory limit,
// at Warn when memoryWarning finds fault with them.
func logMemory(log *zap.Logger, cacheMB int) {
	limit := debug.SetMemoryLimit(-1)
	fields := []zap.Field{zap.Int("cache_mb", cacheMB), zap.Bool("cache_in_go_heap", cacheInGoHeap)}
	if limit != math.MaxInt64 {
		fields = append(fields, zap.Int64("gomemlimit_bytes", limit))
	}
	if w := memoryWarning(cacheInGoHeap, limit, cacheMB); w != "" {
		log.Warn(w, fields...)
		return
	}
	log.Info("memory", fields...)
}
