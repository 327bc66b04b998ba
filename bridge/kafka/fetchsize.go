package kafka

import (
	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
)

// Fetch sizing. A fetch's byte limit counts record batches as stored,
// compressed; kafka-go decompresses a whole response as it reads it, and a
// partition worker holds what it decoded until the store took it (one batch
// handled, one queued, the rest of the fetch). With a fixed limit the
// memory of a partition worker grows with the compression ratio of its
// records: in bench (1 KB records of repeated letters, snappy) up to 42 000
// decoded messages waited in the source on three partitions, and the Go
// heap reached 224 MB (docs/benchmarks.md). Kafka's Java consumer
// decompresses lazily instead, batch by batch as records are polled;
// kafka-go cannot. So each partition asks for as many stored bytes as
// decode to about Config.FetchMaxBytes, learning the ratio from its
// previous fetch.

// minFetchBytes is the smallest limit a partition asks for. The broker
// returns the first batch of a fetch whole even when it is larger, so a
// small limit never stops progress; it only costs round trips, and only
// for records that compress over target/minFetchBytes times (1 024 with the
// default target).
const minFetchBytes = 1 << 10

// stepGrowthLimit bounds how far a partition's limit grows, as a multiple
// of Config.FetchMaxBytes, while it steps past the compacted tail of a
// batch (see fetchSizer.next).
const stepGrowthLimit = 64

// fetchSizer is one partition's fetch limit.
type fetchSizer struct {
	cur    int // the limit of the next fetch, in stored bytes
	target int // decoded bytes aimed at per fetch (Config.FetchMaxBytes)
	// beforeSteps is the limit before a run of steps past a compacted
	// tail doubled it, 0 outside such a run.
	beforeSteps int
}

func newFetchSizer(target int) fetchSizer {
	target = max(target, 1)
	// Start small: after a restart every partition of a backlog fetches
	// at once, before any of them has seen its compression ratio.
	return fetchSizer{cur: min(target, max(minFetchBytes, target/16)), target: target}
}

// limit is the byte limit of the next fetch.
func (f *fetchSizer) limit() int { return f.cur }

// next adjusts the limit after a fetch that decoded decoded bytes of
// records (keys, values and headers of the records handed over).
//
// A fetch that did not reach the end of what is readable filled its limit
// (the broker adds batches until the next would pass it), so limit and
// decoded give the compression ratio, and the next limit is what decodes
// to about target. A fetch that reached it (caughtUp: the log ended, or
// the last stable offset) holds less than its limit and says nothing of
// the ratio: the limit may only shrink then, or a trickle would raise it
// to target stored bytes and the next burst decode to many times target.
//
// stepped says the fetch only moved the position past offsets compaction
// emptied at the end of a batch (decodeRecords): the batch after it did
// not fit in the response, and only a larger limit brings it, so the
// limit doubles (bounded) until it does, and the first fetch that is not
// such a step goes back to the limit from before them. A fetch that
// decoded nothing else (empty, or only markers and aborted records)
// leaves the limit as it is.
func (f *fetchSizer) next(decoded int, stepped, caughtUp bool) {
	f.nextAt(f.cur, decoded, stepped, caughtUp)
}

// nextAt is next after a fetch sent with limit rather than limit(): the
// source's fetch memory budget shrinks a fetch's limit when it grants less
// than a full fetch (memSizer.limitFor), and the ratio is that limit's.
func (f *fetchSizer) nextAt(limit, decoded int, stepped, caughtUp bool) {
	if stepped {
		if f.beforeSteps == 0 {
			f.beforeSteps = f.cur
		}
		f.cur = int(min(int64(f.cur)*2, int64(f.target)*stepGrowthLimit, 1<<30))
		return
	}
	if f.beforeSteps != 0 {
		// A response the steps made large says nothing of the ratio.
		f.cur, f.beforeSteps = f.beforeSteps, 0
		return
	}
	if decoded <= 0 {
		return
	}
	// limit stored bytes decoded to decoded: ask for what decodes to about
	// target. Integer math in int64: limit*target may pass 2^31.
	want := int64(limit) * int64(f.target) / int64(decoded)
	if caughtUp {
		want = min(want, int64(f.cur))
	}
	f.cur = int(min(max(want, int64(min(minFetchBytes, f.target))), int64(f.target)))
}

// stepping says the last fetch was a step past a compacted tail.
func (f *fetchSizer) stepping() bool { return f.beforeSteps != 0 }

// decodedBytes is what items hold of their records: keys, values and
// headers, each header with its codec.Header (a record of many empty
// headers is small on the wire and not in memory).
func decodedBytes(items []bridge.Item) int {
	n := 0
	for i := range items {
		m := &items[i].Msg
		n += len(m.Key) + len(m.Value)
		for _, h := range m.Headers {
			n += len(h.Key) + len(h.Value) + codec.HeaderMemory
		}
	}
	return n
}

// probeFetchBytes is the limit of the identity checks' fetches. They look
// at the record at one offset, whose batch the broker returns whole as
// the first one, and every partition of the group checks at once at
// start: the smallest limit serves.
func probeFetchBytes(cfg *Config) int { return min(minFetchBytes, cfg.FetchMaxBytes) }
