package benchrun

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/delaybridge/delaybridge/bridge/kafka"
	"github.com/delaybridge/delaybridge/bridge/nats"
	"github.com/delaybridge/delaybridge/codec"
	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
)

// msgSize is the value size of every benchmark message.
const msgSize = 1024

// warmupID marks the message each bridge run sends first, so the
// measurement starts with the consumer group joined and the connections
// up.
const warmupID = math.MaxUint32

// warmBase is the first id of a warm-up burst (bridgeRun's warm), far from
// the measured ids (0..n-1).
const warmBase = 1 << 31

func value(id uint32) []byte {
	v := make([]byte, msgSize)
	binary.BigEndian.PutUint32(v, id)
	for i := 4; i < len(v); i++ {
		v[i] = byte('a' + i%26)
	}
	return v
}

// publisher writes n 1 KB messages to one subject/topic, paced at rate
// msg/s (0: as fast as the broker takes them), and returns when the broker
// acknowledged all of them.
type publisher interface {
	publish(ctx context.Context, first uint32, n, rate int, headers []codec.Header) error
	close()
}

type kafkaPub struct {
	cl    *kgo.Client
	topic string
}

func newKafkaPub(addr, topic string) (*kafkaPub, error) {
	cl, err := kgo.NewClient(kgo.SeedBrokers(addr), kgo.MaxBufferedRecords(20000), kgo.ProducerLinger(time.Millisecond))
	if err != nil {
		return nil, fmt.Errorf("benchrun: kafka producer: %w", err)
	}
	return &kafkaPub{cl: cl, topic: topic}, nil
}

func (p *kafkaPub) publish(ctx context.Context, first uint32, n, rate int, headers []codec.Header) error {
	var hs []kgo.RecordHeader
	for _, h := range headers {
		hs = append(hs, kgo.RecordHeader{Key: h.Key, Value: h.Value})
	}
	var failed atomic.Pointer[error]
	pace := newPacer(rate)
	for i := range n {
		if err := pace.wait(ctx, i); err != nil {
			return err
		}
		id := first + uint32(i)
		p.cl.Produce(ctx, &kgo.Record{Topic: p.topic, Key: value(id)[:4], Value: value(id), Headers: hs}, func(_ *kgo.Record, err error) {
			if err != nil {
				failed.CompareAndSwap(nil, &err)
			}
		})
	}
	if err := p.cl.Flush(ctx); err != nil {
		return fmt.Errorf("benchrun: kafka flush: %w", err)
	}
	if e := failed.Load(); e != nil {
		return fmt.Errorf("benchrun: kafka produce: %w", *e)
	}
	return nil
}

func (p *kafkaPub) close() { p.cl.Close() }

type natsPub struct {
	nc      *natsgo.Conn
	js      jetstream.JetStream
	subject string
}

func newNATSPub(url, subject string) (*natsPub, error) {
	nc, err := natsgo.Connect(url)
	if err != nil {
		return nil, fmt.Errorf("benchrun: nats publisher: %w", err)
	}
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		nc.Close()
		return nil, err
	}
	return &natsPub{nc: nc, js: js, subject: subject}, nil
}

func (p *natsPub) publish(ctx context.Context, first uint32, n, rate int, headers []codec.Header) error {
	pace := newPacer(rate)
	for i := range n {
		if err := pace.wait(ctx, i); err != nil {
			return err
		}
		m := natsgo.NewMsg(p.subject)
		m.Data = value(first + uint32(i))
		for _, h := range headers {
			m.Header.Set(h.Key, string(h.Value))
		}
		if _, err := p.js.PublishMsgAsync(m); err != nil {
			return fmt.Errorf("benchrun: nats publish: %w", err)
		}
	}
	select {
	case <-p.js.PublishAsyncComplete():
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (p *natsPub) close() { p.nc.Close() }

func newPublisher(b *broker, dest string) (publisher, error) {
	if b.transport == Kafka {
		return newKafkaPub(b.addr(), dest)
	}
	return newNATSPub(b.addr(), dest)
}

// pacer releases message i at start + i/rate.
type pacer struct {
	rate  int
	start time.Time
}

func newPacer(rate int) *pacer { return &pacer{rate: rate, start: time.Now()} }

func (p *pacer) wait(ctx context.Context, i int) error {
	if p.rate <= 0 {
		return ctx.Err()
	}
	at := p.start.Add(time.Duration(int64(i) * int64(time.Second) / int64(p.rate)))
	if d := time.Until(at); d > time.Millisecond {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
	return nil
}

// receipt is one message seen at the target.
type receipt struct {
	recv time.Time
	due  int64 // delay-due, Unix ms
}

// targetReader reads the bridge's target and records when each id arrived.
type targetReader struct {
	mu      sync.Mutex
	got     map[uint32]receipt
	dups    int
	changed chan struct{}
	stop    func()
	// ignoreFrom, when not 0: ids from it on (a warm-up burst's, but
	// warmupID) are no longer recorded (see forget).
	ignoreFrom uint32
}

func (r *targetReader) add(id uint32, due int64) {
	now := time.Now()
	r.mu.Lock()
	if r.ignoreFrom != 0 && id >= r.ignoreFrom && id != warmupID {
		r.mu.Unlock()
		return
	}
	if _, ok := r.got[id]; ok {
		r.dups++
	} else {
		r.got[id] = receipt{recv: now, due: due}
	}
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func (r *targetReader) has(id uint32) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	_, ok := r.got[id]
	return ok
}

// forget drops what arrived so far but the warm-up message, and from now
// on ignores the ids from `from` on, those of a warm-up burst: the
// measurement after it starts clean.
func (r *targetReader) forget(from uint32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	kept := map[uint32]receipt{}
	if rc, ok := r.got[warmupID]; ok {
		kept[warmupID] = rc
	}
	r.got, r.dups, r.ignoreFrom = kept, 0, from
}

func (r *targetReader) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := len(r.got)
	if _, ok := r.got[warmupID]; ok {
		n--
	}
	return n
}

// span is when the first and the last message arrived (the warm-up
// message left out), and how many arrived twice.
func (r *targetReader) span() (first, last time.Time, dups int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for id, rc := range r.got {
		if id == warmupID {
			continue
		}
		if first.IsZero() || rc.recv.Before(first) {
			first = rc.recv
		}
		if rc.recv.After(last) {
			last = rc.recv
		}
	}
	return first, last, r.dups
}

func parseDue(s string) int64 {
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return 0
	}
	return t.UnixMilli()
}

// readTarget consumes topic (Kafka) or stream (NATS) from its start and
// records when each message arrived.
func readTarget(b *broker, topic, stream string) (*targetReader, error) {
	r := &targetReader{got: map[uint32]receipt{}, changed: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	switch b.transport {
	case Kafka:
		cl, err := kgo.NewClient(kgo.SeedBrokers(b.addr()), kgo.ConsumeTopics(topic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(50*time.Millisecond))
		if err != nil {
			cancel()
			return nil, fmt.Errorf("benchrun: kafka consumer: %w", err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for ctx.Err() == nil {
				fs := cl.PollFetches(ctx)
				fs.EachRecord(func(rec *kgo.Record) {
					if len(rec.Value) < 4 {
						return
					}
					var due int64
					for _, h := range rec.Headers {
						if h.Key == codec.HeaderDue {
							due = parseDue(string(h.Value))
						}
					}
					r.add(binary.BigEndian.Uint32(rec.Value), due)
				})
			}
		}()
		r.stop = func() { cancel(); <-done; cl.Close() }
	case NATS:
		nc, err := natsgo.Connect(b.addr())
		if err != nil {
			cancel()
			return nil, fmt.Errorf("benchrun: nats consumer: %w", err)
		}
		js, err := jetstream.New(nc)
		if err != nil {
			cancel()
			nc.Close()
			return nil, err
		}
		cons, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
		if err != nil {
			cancel()
			nc.Close()
			return nil, fmt.Errorf("benchrun: nats consumer: %w", err)
		}
		cc, err := cons.Consume(func(m jetstream.Msg) {
			if len(m.Data()) < 4 {
				return
			}
			r.add(binary.BigEndian.Uint32(m.Data()), parseDue(m.Headers().Get(codec.HeaderDue)))
		}, jetstream.PullMaxMessages(4096))
		if err != nil {
			cancel()
			nc.Close()
			return nil, fmt.Errorf("benchrun: nats consume: %w", err)
		}
		r.stop = func() { cc.Stop(); cancel(); nc.Close() }
	default:
		cancel()
		return nil, fmt.Errorf("benchrun: unknown transport %q", b.transport)
	}
	return r, nil
}

// wait blocks until cond holds or ctx is done.
func (r *targetReader) wait(ctx context.Context, cond func() bool) error {
	for !cond() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-r.changed:
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// Measurement is one throughput or lateness measurement.
type Measurement struct {
	Transport string `json:"transport"`
	// Mode: "raw" (RawPipe, no delay, no store), "raw-read" (the same with
	// a consumer reading its target), "bridge" (as fast as the publisher
	// goes), "bridge-warm" (the same after Warm messages went through the
	// same bridge process) or "paced" (publisher paced at Rate msg/s).
	Mode        string  `json:"mode"`
	N           int     `json:"n"`
	Warm        int     `json:"warm,omitempty"`         // messages through the bridge before the measured ones
	PublishRate int     `json:"publish_rate,omitempty"` // paced target, msg/s
	DelayMs     int64   `json:"delay_ms"`
	Seconds     float64 `json:"seconds"` // the denominator of Rate
	// Rate: raw: n / (the pipe's last produce acknowledged - first
	// publish), nobody reading raw.out; raw-read: n / (last copy read at a
	// consumer of raw.out - first publish); bridge and paced: n / (last
	// delivery at the target consumer - first publish - delay).
	Rate float64 `json:"rate"`
	// IngestRate: n / (time the bridge's ingested counter reached n - first publish).
	IngestRate float64 `json:"ingest_rate,omitempty"`
	// FireRate: n / (last delivery - first delivery), at the target consumer.
	FireRate   float64  `json:"fire_rate,omitempty"`
	Lateness   *Summary `json:"lateness_ms,omitempty"`
	Duplicates int      `json:"duplicates"`
	// IngestCommits and IngestCommitMs (mean) are the bridge's synced
	// ingest commits during the run (delaybridge_store_commit_seconds).
	IngestCommits  uint64  `json:"ingest_commits,omitempty"`
	IngestCommitMs float64 `json:"ingest_commit_ms,omitempty"`
	// Publishes and PublishMs (mean) are the bridge's fire-time publish
	// calls to the target broker during the run
	// (delaybridge_publish_seconds); n / Publishes is the mean batch.
	Publishes uint64  `json:"publishes,omitempty"`
	PublishMs float64 `json:"publish_ms,omitempty"`
	// PeakRSSMB is VmHWM of the benchmark process after the run: it
	// includes the in-process brokers and clients (and the bridge when it
	// runs in process).
	PeakRSSMB float64 `json:"peak_rss_mb"`
	// BridgeRSSMB is VmHWM of the bridge child process (`delaybridge run`),
	// 0 when the bridge ran in process.
	BridgeRSSMB float64 `json:"bridge_peak_rss_mb,omitempty"`
	// BridgeCPUUs is the CPU time (user + system) the bridge child spent
	// per message from the first publish to the last delivery, in
	// microseconds (process_cpu_seconds_total): steadier than the rates
	// when the brokers and clients share the cores. 0 in process.
	BridgeCPUUs float64 `json:"bridge_cpu_us_per_msg,omitempty"`
	// BenchCPUUs is the CPU time of this (the benchmark) process per
	// message over the same span: the in-process brokers, the publisher,
	// the target consumer and, in a raw run, the pipe itself (and the
	// bridge, when it runs in process). With the bridge child's it
	// accounts for the whole machine's work.
	BenchCPUUs float64 `json:"bench_cpu_us_per_msg,omitempty"`
	// BridgeFaults and BenchFaults are the minor page faults (first
	// touches of memory pages) per message over the same span, of the
	// bridge child and of this process. Where a fresh page is expensive
	// (Machine.FreshPageUs) they are a large part of the CPU columns.
	BridgeFaults float64   `json:"bridge_faults_per_msg,omitempty"`
	BenchFaults  float64   `json:"bench_faults_per_msg,omitempty"`
	samples      []float64 // lateness in ms, for the chart
}

// Summary is a lateness distribution in milliseconds.
type Summary struct {
	P50  float64 `json:"p50"`
	P99  float64 `json:"p99"`
	P999 float64 `json:"p999"`
	Max  float64 `json:"max"`
	Mean float64 `json:"mean"`
}

func summarize(xs []float64) *Summary {
	if len(xs) == 0 {
		return nil
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	q := func(p float64) float64 { return s[min(len(s)-1, int(math.Ceil(p*float64(len(s))))-1)] }
	var sum float64
	for _, x := range s {
		sum += x
	}
	return &Summary{P50: q(0.5), P99: q(0.99), P999: q(0.999), Max: s[len(s)-1], Mean: sum / float64(len(s))}
}

// rawRun measures the adapter's raw consume -> produce pipe: n messages
// published to raw.in while the pipe copies them to raw.out. Without read
// the rate is the pipe's own: until the target broker acknowledged the last
// copy (mode "raw"). With read a consumer reads raw.out as the target
// consumer does in a bridge run, and the rate is measured at it (mode
// "raw-read"), so the brokers carry the same streams as in a bridge run.
func rawRun(ctx context.Context, transport string, n int, dir string, read bool) (*Measurement, error) {
	b, err := startBroker(transport, dir)
	if err != nil {
		return nil, err
	}
	defer b.close()
	var tr *targetReader
	if read {
		if tr, err = readTarget(b, "raw.out", "RAWOUT"); err != nil {
			return nil, err
		}
		defer tr.stop()
	}
	pub, err := newPublisher(b, "raw.in")
	if err != nil {
		return nil, err
	}
	defer pub.close()
	cpu0, faults0 := selfCPUSeconds(), selfMinorFaults()
	start := time.Now()
	pubErr := make(chan error, 1)
	go func() { pubErr <- pub.publish(ctx, 0, n, 0, nil) }()
	switch transport {
	case Kafka:
		_, err = kafka.RawPipe(ctx, []string{b.addr()}, "raw.in", "raw.out", n)
	case NATS:
		_, err = nats.RawPipe(ctx, b.addr(), "RAWIN", "raw.in", "raw.out", n)
	}
	end := time.Now()
	if err != nil {
		return nil, fmt.Errorf("benchrun: %s raw pipe: %w", transport, err)
	}
	if err := <-pubErr; err != nil {
		return nil, err
	}
	run := &Measurement{Transport: transport, Mode: "raw", N: n}
	if read {
		limit := time.Duration(n/1000)*time.Second + time.Minute
		dctx, cancel := context.WithTimeout(ctx, limit)
		defer cancel()
		if err := tr.wait(dctx, func() bool { return tr.count() >= n }); err != nil {
			return nil, fmt.Errorf("benchrun: %s raw pipe: %d of %d read at raw.out within %v: %w", transport, tr.count(), n, limit, err)
		}
		run.Mode = "raw-read"
		_, end, run.Duplicates = tr.span()
	}
	run.Seconds = end.Sub(start).Seconds()
	run.Rate = float64(n) / run.Seconds
	run.BenchCPUUs = (selfCPUSeconds() - cpu0) / float64(n) * 1e6
	run.BenchFaults = (selfMinorFaults() - faults0) / float64(n)
	run.PeakRSSMB = peakRSSMB()
	return run, nil
}

// ingestPoll is how often a run polls the bridge's ingested count.
const ingestPoll = 200 * time.Millisecond

// poll is one read of a count.
type poll struct {
	at    time.Time
	count float64
}

// crossing estimates when a count reached want, seen below it at prev and
// before that at prev2, and at or above it at last. The count stops at
// want (only that many messages are sent), so last says nothing of when
// it got there: the rate between prev2 and prev carries the count on from
// prev, and the estimate is kept within (prev.at, last.at]. Without a rate
// (a first poll, a stalled count) it is last.at.
func crossing(prev2, prev, last poll, want float64) time.Time {
	dt := prev.at.Sub(prev2.at)
	if dc := prev.count - prev2.count; dc > 0 && dt > 0 && want > prev.count {
		est := prev.at.Add(time.Duration(float64(dt) * (want - prev.count) / dc))
		if est.Before(last.at) {
			return est
		}
	}
	return last.at
}

// profileSecs is how much of a bridge run a CPU profile covers.
const profileSecs = 3

// bridgeRun measures the whole bridge: n messages published with a delay
// of delay to the delay source, read at the target. With profile set (and
// the bridge a child process) the first profileSecs of the measured run
// are recorded as a CPU profile of the bridge into that file.
//
// warm > 0 first sends warm messages the same way (ids from warmBase on)
// and waits for all of them at the target: the measured run then finds the
// bridge process as a long-running one would, its memory already taken
// from the system (the memtable arenas, the heap). On a machine where a
// fresh page is expensive (Machine.FreshPageUs) that is most of the
// difference to the first run.
func bridgeRun(ctx context.Context, transport string, n, rate, warm int, delay time.Duration, dir, exe, profile string, log *zap.Logger) (*Measurement, error) {
	b, err := startBroker(transport, dir)
	if err != nil {
		return nil, err
	}
	defer b.close()
	var br bridgeRunner
	if exe != "" {
		br, err = startChildBridge(ctx, exe, b, filepath.Join(dir, "store"), profile != "")
	} else {
		br, err = startBridge(ctx, b, filepath.Join(dir, "store"), log)
	}
	if err != nil {
		return nil, err
	}
	defer br.close()
	tr, err := readTarget(b, "orders", "ORDERS")
	if err != nil {
		return nil, err
	}
	defer tr.stop()
	src, target := "delay", "orders"
	if transport == NATS {
		src, target = "delay.bench", "orders.bench"
	}
	pub, err := newPublisher(b, src)
	if err != nil {
		return nil, err
	}
	defer pub.close()

	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := pub.publish(wctx, warmupID, 1, 0, []codec.Header{
		{Key: codec.HeaderAfter, Value: []byte("0")}, {Key: codec.HeaderTarget, Value: []byte(target)}}); err != nil {
		return nil, err
	}
	if err := tr.wait(wctx, func() bool { return tr.has(warmupID) }); err != nil {
		return nil, fmt.Errorf("benchrun: %s bridge: warm-up message not delivered: %w", transport, err)
	}
	if warm > 0 {
		hdrs := []codec.Header{{Key: codec.HeaderAfter, Value: []byte(fmt.Sprint(delay.Milliseconds()))}, {Key: codec.HeaderTarget, Value: []byte(target)}}
		limit := time.Duration(warm/1000)*time.Second + 5*time.Minute
		bctx, cancel := context.WithTimeout(ctx, limit)
		defer cancel()
		if err := pub.publish(bctx, warmBase, warm, 0, hdrs); err != nil {
			return nil, err
		}
		// Only the warm-up ids have arrived so far (count leaves out
		// warmupID).
		if err := tr.wait(bctx, func() bool { return tr.count() >= warm }); err != nil {
			return nil, fmt.Errorf("benchrun: %s bridge: %d of %d warm-up messages delivered within %v: %w", transport, tr.count(), warm, limit, err)
		}
		tr.forget(warmBase)
	}

	var ingestedAt atomic.Int64
	base := br.counter("delaybridge_ingested_total")
	commits0, commitSecs0 := br.histogram("delaybridge_store_commit_seconds", "op", "ingest")
	pubs0, pubSecs0 := br.histogram("delaybridge_publish_seconds", "transport", transport)
	pollCtx, stopPoll := context.WithCancel(ctx)
	defer stopPoll()
	// A scrape costs the bridge a registry gather (about 2 ms of CPU
	// here); polling every 20 ms took a fifth of a core from the bridge
	// being measured. Poll every ingestPoll and estimate the moment the
	// count reached n from the rate before (crossing). A bridge that is
	// behind takes in the last messages
	// when they are already due, so the deliveries can end before the
	// next poll: one last read after them (lastPoll) closes the span.
	prev2 := poll{at: time.Now()}
	prev := prev2
	pollDone := make(chan struct{})
	go func() {
		defer close(pollDone)
		for pollCtx.Err() == nil {
			p := poll{count: br.counter("delaybridge_ingested_total") - base, at: time.Now()}
			if p.count >= float64(n) {
				ingestedAt.Store(crossing(prev2, prev, p, float64(n)).UnixNano())
				return
			}
			prev2, prev = prev, p
			select {
			case <-pollCtx.Done():
			case <-time.After(ingestPoll):
			}
		}
	}()
	lastPoll := func() {
		stopPoll()
		<-pollDone
		if ingestedAt.Load() != 0 {
			return
		}
		if p := (poll{count: br.counter("delaybridge_ingested_total") - base, at: time.Now()}); p.count >= float64(n) {
			ingestedAt.Store(crossing(prev2, prev, p, float64(n)).UnixNano())
		}
	}

	profErr := make(chan error, 1)
	if cb, ok := br.(*childBridge); ok && profile != "" {
		go func() { profErr <- cb.cpuProfile(profileSecs, profile) }()
	} else {
		profErr <- nil
	}
	cpu0, self0 := br.cpuSeconds(), selfCPUSeconds()
	faults0, selfFaults0 := br.minorFaults(), selfMinorFaults()
	start := time.Now()
	pubErr := make(chan error, 1)
	go func() {
		pubErr <- pub.publish(ctx, 0, n, rate, []codec.Header{
			{Key: codec.HeaderAfter, Value: []byte(fmt.Sprint(delay.Milliseconds()))}, {Key: codec.HeaderTarget, Value: []byte(target)}})
	}()
	limit := time.Duration(n/1000)*time.Second + 5*time.Minute
	dctx, cancel2 := context.WithTimeout(ctx, limit)
	defer cancel2()
	werr := tr.wait(dctx, func() bool { return tr.count() >= n })
	lastPoll()
	if err := <-pubErr; err != nil {
		return nil, err
	}
	if werr != nil {
		return nil, fmt.Errorf("benchrun: %s bridge: %d of %d delivered within %v: %w", transport, tr.count(), n, limit, werr)
	}
	benchUs := (selfCPUSeconds() - self0) / float64(n) * 1e6
	benchFaults := (selfMinorFaults() - selfFaults0) / float64(n)
	var bridgeFaults float64
	if f := br.minorFaults(); f > 0 {
		bridgeFaults = (f - faults0) / float64(n)
	}
	var cpuUs float64
	if cpu := br.cpuSeconds(); cpu > 0 {
		cpuUs = (cpu - cpu0) / float64(n) * 1e6
	}
	if err := <-profErr; err != nil {
		return nil, err
	}

	first, last, dups := tr.span()
	tr.mu.Lock()
	lat := make([]float64, 0, n)
	for id, rc := range tr.got {
		if id != warmupID {
			lat = append(lat, float64(rc.recv.UnixNano()-rc.due*int64(time.Millisecond))/1e6)
		}
	}
	tr.mu.Unlock()

	mode := "bridge"
	switch {
	case rate > 0:
		mode = "paced"
	case warm > 0:
		mode = "bridge-warm"
	}
	secs := last.Sub(start).Seconds() - delay.Seconds()
	run := &Measurement{Transport: transport, Mode: mode, N: n, Warm: warm, PublishRate: rate, DelayMs: delay.Milliseconds(), Seconds: secs,
		Rate: float64(n) / secs, Lateness: summarize(lat), Duplicates: dups, PeakRSSMB: peakRSSMB(), samples: lat,
		BridgeRSSMB: br.peakRSSMB(), BridgeCPUUs: cpuUs, BenchCPUUs: benchUs, BridgeFaults: bridgeFaults, BenchFaults: benchFaults}
	if at := ingestedAt.Load(); at > 0 {
		run.IngestRate = float64(n) / time.Unix(0, at).Sub(start).Seconds()
	}
	if d := last.Sub(first).Seconds(); d > 0 {
		run.FireRate = float64(n) / d
	}
	if c, s := br.histogram("delaybridge_store_commit_seconds", "op", "ingest"); c > commits0 {
		run.IngestCommits = c - commits0
		run.IngestCommitMs = (s - commitSecs0) / float64(c-commits0) * 1000
	}
	if c, s := br.histogram("delaybridge_publish_seconds", "transport", transport); c > pubs0 {
		run.Publishes = c - pubs0
		run.PublishMs = (s - pubSecs0) / float64(c-pubs0) * 1000
	}
	if err := br.close(); err != nil && !errors.Is(err, context.Canceled) {
		return run, fmt.Errorf("benchrun: %s bridge stop: %w", transport, err)
	}
	return run, nil
}
