package kafka

import (
	"sync"
	"time"
)

// poolDrops drops a kafka-go transport's connection pools, so that the
// next request builds one that reads the metadata anew. A dropped pool
// holds its metadata until transportIdle (640 KB on a cluster of 2 000
// partitions when that was the whole cluster's, hunt H208; Source and
// Sink now read their topics' only), and the new one reads it again from
// a broker. A leader move or a broker restart fails many requests at once
// (every partition's fetch it led, every shard's publish lane), and each
// dropped the pools (reviews F211, R212): once applies one drop to all
// the requests that began before it.
type poolDrops struct {
	mu   sync.Mutex
	last time.Time // when the last drop began
	n    int       // drops (tests)
}

// poolDropper is a kafka-go Transport, or the Sink's scopedTransport.
type poolDropper interface{ CloseIdleConnections() }

// drop drops t's pools.
func (p *poolDrops) drop(t poolDropper) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropLocked(t)
}

// once drops t's pools unless they were dropped since since: the pool in
// use then read its metadata after since, so a request that began at
// since and failed on stale metadata finds it fresh.
func (p *poolDrops) once(t poolDropper, since time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.last.After(since) {
		p.dropLocked(t)
	}
}

func (p *poolDrops) dropLocked(t poolDropper) {
	p.last = time.Now()
	p.n++
	t.CloseIdleConnections()
}

// count is how many drops there were.
func (p *poolDrops) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}
