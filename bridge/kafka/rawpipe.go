package kafka

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
)

// RawPipe copies n messages from topic from (all partitions, from the start
// of the log) to topic to with the adapter's own fetch path and producer
// settings, and returns how long it took. It is the no-delay, no-store
// baseline that benchmarks of the whole bridge compare with. It may copy a
// few more than n messages when several partitions race to the end.
func RawPipe(ctx context.Context, brokers []string, from, to string, n int) (time.Duration, error) {
	if n <= 0 {
		return 0, nil
	}
	cfg := Config{Brokers: brokers, ClientID: "delaybridge-rawpipe"}
	cfg.setDefaults()
	if err := cfg.validate(false); err != nil {
		return 0, err
	}
	start := time.Now()
	t := cfg.transport()
	defer t.CloseIdleConnections()
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: t}
	md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{from}})
	if err != nil {
		return 0, fmt.Errorf("kafka: rawpipe: metadata of %q: %w", from, err)
	}
	var parts []int
	for _, tp := range md.Topics {
		if tp.Name != from {
			continue
		}
		if tp.Error != nil {
			return 0, fmt.Errorf("kafka: rawpipe: topic %q: %w", from, tp.Error)
		}
		for _, p := range tp.Partitions {
			parts = append(parts, p.ID)
		}
	}
	if len(parts) == 0 {
		return 0, fmt.Errorf("kafka: rawpipe: topic %q: %w", from, kafkago.UnknownTopicOrPartition)
	}

	w := newWriter(&cfg, limitInFlight(t, maxProduceInFlight), zap.NewNop())
	defer func() { _ = w.Close() }()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		copied  atomic.Int64
		wg      sync.WaitGroup
		errOnce sync.Once
		pipeErr error
	)
	fail := func(err error) {
		errOnce.Do(func() { pipeErr = err })
		cancel()
	}
	for _, p := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			offset := kafkago.FirstOffset
			var items []bridge.Item
			size := newFetchSizer(cfg.FetchMaxBytes) // as the source sizes its fetches
			for ctx.Err() == nil {
				var err error
				var hw int64
				var notes decodeNotes
				items, offset, hw, err = fetchItems(ctx, client, &cfg, from, p, offset, cfg.MaxWait, size.limit(), nil, items[:0], &notes)
				caughtUp := err == nil && hw >= 0 && offset >= hw
				size.next(decodedBytes(items), notes.stepped && len(items) == 0 && !caughtUp, caughtUp)
				if err != nil {
					if ctx.Err() == nil {
						fail(fmt.Errorf("kafka: rawpipe: fetch %s/%d: %w", from, p, err))
					}
					return
				}
				if len(items) == 0 {
					continue
				}
				msgs := make([]kafkago.Message, len(items))
				now := time.Now()
				for i := range items {
					m := &items[i].Msg
					msgs[i] = kafkago.Message{Topic: to, Key: m.Key, Value: m.Value, Time: now}
					for _, h := range m.Headers {
						msgs[i].Headers = append(msgs[i].Headers, kafkago.Header{Key: h.Key, Value: h.Value})
					}
				}
				if err := w.WriteMessages(ctx, msgs...); err != nil {
					if ctx.Err() == nil {
						fail(fmt.Errorf("kafka: rawpipe: write %s: %w", to, err))
					}
					return
				}
				if copied.Add(int64(len(msgs))) >= int64(n) {
					cancel()
					return
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if copied.Load() >= int64(n) {
		return elapsed, nil
	}
	if pipeErr != nil {
		return elapsed, pipeErr
	}
	return elapsed, fmt.Errorf("kafka: rawpipe: copied %d of %d: %w", copied.Load(), n, ctx.Err())
}
