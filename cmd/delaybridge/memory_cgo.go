//go:build cgo

package main

// cacheInGoHeap: built with cgo, Pebble allocates its block cache and
// memtables with C calloc (its internal/manual package), outside the Go
// heap.
const cacheInGoHeap = false
