//go:build !cgo

package main

// cacheInGoHeap: built without cgo, Pebble allocates its block cache and
// memtables with make (its internal/manual package): they are Go heap.
const cacheInGoHeap = true
