package nats

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/shard"
)

// dueLayout is delay-due's format: RFC 3339, milliseconds, UTC.
const dueLayout = "2006-01-02T15:04:05.000Z07:00"

// Sink delivers due tasks to NATS subjects. It implements shard.Sink and
// bridge.Healther; Deliver may be called from several shards at once. See
// the package documentation for the Nats-Msg-Id of deliveries, the headers
// not forwarded, and subjects without a stream.
type Sink struct {
	nc      *natsgo.Conn
	js      jetstream.JetStream
	cfg     Config
	log     *zap.Logger
	pubOpts []jetstream.PublishOpt
	// lastAck is when any Deliver last saw a PubAck, or an answer of the
	// JetStream API to ping, in ns since epoch (monotonic: a step of the
	// wall clock does not move it): the reference of a batch with none
	// of its own (see Deliver's stragglers).
	lastAck atomic.Int64
	epoch   time.Time
	// ping asks the JetStream API something cheap and reports whether
	// it answered (a variable for tests: a slow cluster).
	ping func(ctx context.Context) bool
	// probeWait is how long a JetStream publish to a subject of unknown
	// kind waits for its PubAck before the Sink asks whether a stream
	// captures the subject at all.
	probeWait time.Duration

	mu sync.Mutex
	// What deliveries found out about target subjects, each verdict
	// standing for NoStreamTTL.
	verdicts map[string]verdict
	// A failed stream lookup is not repeated before lookupUntil; meanwhile
	// lookupErr answers for it.
	lookupErr   error
	lookupUntil time.Time
	now         func() time.Time
	// denied: subjects the server refused the bridge's user a publish to
	// (an async "permissions violation"), and when; see noteAsyncError.
	denied map[string]time.Time
	// noAckStreams: whether a stream is configured with no_ack; see noAck.
	noAckStreams map[string]noAckVerdict
	// slowOK: target subjects whose stragglers are not cut (see
	// stragglerGrace), until when: a publish to them that was cut was
	// acknowledged after all, so they answer late but work.
	slowOK map[string]time.Time
	// streamOf: the stream that last acknowledged a publish to a target
	// subject (from its PubAck), so a batch's stragglers are judged by
	// their stream's answers, not only their subject's (review R188).
	streamOf map[string]string
}

// maxNoted bounds Sink.denied and Sink.noAckStreams; past it a map starts
// over.
const maxNoted = 1024

// maxStreamOf bounds Sink.streamOf (about 100 bytes an entry): one per
// target subject, and tenants may have a subject each.
const maxStreamOf = 16384

// publishDeniedRe finds the subject in the server's permissions error,
// which quotes it Go-style (%q): escapes are undone with strconv.Unquote.
var publishDeniedRe = regexp.MustCompile(`(?i)publish to ("(?:[^"\\]|\\.)*")`)

// noteAsyncError takes the connection's async errors. The server answers a
// publish the user may not make with an -ERR, which nats.go passes only to
// the async handler: the publish itself just gets no PubAck. Noting the
// subject lets Deliver tell that timeout from an outage.
func (s *Sink) noteAsyncError(err error) {
	if !errors.Is(err, natsgo.ErrPermissionViolation) {
		return
	}
	m := publishDeniedRe.FindStringSubmatch(err.Error())
	if m == nil {
		return
	}
	subject, uerr := strconv.Unquote(m[1])
	if uerr != nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.denied) >= maxNoted {
		clear(s.denied)
	}
	s.denied[subject] = s.now()
}

// deniedSince reports whether a publish to subject was refused for
// permissions at or after t.
func (s *Sink) deniedSince(subject string, t time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	at, ok := s.denied[subject]
	return ok && !at.Before(t)
}

// verdict is what the Sink knows about a target subject.
type verdict struct {
	core  bool      // no stream captures it: core NATS; else a stream acknowledged a publish
	until time.Time // then it is found out again
}

const (
	// streamLookupTimeout bounds the question "does a stream capture this
	// subject?" apart from the PubAck budget (Config.PublishTimeout): a
	// server that does not answer it (e.g. to a user without permission
	// for $JS.API.STREAM.NAMES) costs little, and the failure is kept for
	// NoStreamTTL.
	streamLookupTimeout = 2 * time.Second
	// defaultProbeWait is Sink.probeWait (at most half PublishTimeout).
	defaultProbeWait = time.Second
	// maxVerdicts bounds the verdict cache; past it, expired verdicts are
	// swept, and if half of it is still live it starts over.
	maxVerdicts = 4096
	// stragglerGraceMin and stragglerGraceFactor: the grace of a batch's
	// stragglers (stragglerGrace), at least stragglerGraceMin and
	// stragglerGraceFactor times the time the batch took to its last
	// PubAck.
	stragglerGraceMin    = time.Second
	stragglerGraceFactor = 4
	// stragglerPoll is how often a Deliver blocked on one PubAck looks
	// whether the others of the batch have come.
	stragglerPoll = 20 * time.Millisecond
)

// pingJS asks the JetStream API something cheap (within
// streamLookupTimeout) and, if it answers, takes that for a PubAck in
// lastAck: the servers answer. A lone straggler of a stream that lost its
// quorum, in a batch of one with nothing else acknowledged meanwhile, is
// then cut too; in a slow cluster (or without permission for the API)
// the ping does not answer and nothing is cut.
func (s *Sink) pingJS(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, streamLookupTimeout)
	defer cancel()
	if s.ping(ctx) {
		s.lastAck.Store(int64(time.Since(s.epoch)))
	}
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// stragglerGrace is how long the stragglers of a batch (publishes to
// subjects that acknowledged nothing in it) are waited for after the batch's
// last PubAck, which came took after the batch began: a few times took,
// at least stragglerGraceMin. PublishTimeout still bounds the whole wait.
func stragglerGrace(took time.Duration) time.Duration {
	return max(stragglerGraceFactor*took, stragglerGraceMin)
}

// slowSubject reports whether subject's stragglers are waited for the
// whole PublishTimeout: a cut publish to it was acknowledged after all
// within NoStreamTTL.
func (s *Sink) slowSubject(subject string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.slowLocked(subject) {
		return true
	}
	stream, ok := s.streamOf[subject]
	return ok && s.slowLocked(streamKey(stream))
}

// slowLocked reports whether key (a subject, or a streamKey) is noted
// slow and not expired; s.mu held.
func (s *Sink) slowLocked(key string) bool {
	until, ok := s.slowOK[key]
	if ok && !s.now().Before(until) {
		delete(s.slowOK, key)
		return false
	}
	return ok
}

// streamKey is a stream's key in Sink.slowOK, apart from subjects (a
// subject has no NUL).
func streamKey(stream string) string { return "\x00" + stream }

// noteSlow records that subject answers late but works, through its
// stream if known (the stream that acknowledged it late: every subject it
// is known to capture), else as a subject: their stragglers are not cut
// for NoStreamTTL. Only the stream is noted when known, so a stream with
// a subject per key takes one entry of slowOK, not one a key (R191). It
// reports whether that was not known.
func (s *Sink) noteSlow(subject, stream string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.slowOK) >= maxNoted {
		clear(s.slowOK)
	}
	now := s.now()
	key := subject
	if stream != "" {
		key = streamKey(stream)
		s.noteStreamLocked(subject, stream)
	}
	until, known := s.slowOK[key]
	s.slowOK[key] = now.Add(s.cfg.NoStreamTTL)
	return !known || !now.Before(until)
}

// noteStreamLocked records that stream acknowledged a publish to
// subject; s.mu held.
func (s *Sink) noteStreamLocked(subject, stream string) {
	if s.streamOf[subject] == stream {
		return
	}
	if len(s.streamOf) >= maxStreamOf {
		clear(s.streamOf)
	}
	s.streamOf[subject] = stream
}

// knownStream reports whether a stream is known to have acknowledged a
// publish to subject (Sink.streamOf).
func (s *Sink) knownStream(subject string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.streamOf[subject]
	return ok
}

// watchCut waits for the answers to the publishes to subject Deliver
// stopped waiting for in one batch (the library gives each one within
// PublishTimeout): one acknowledged after all, its subject is slow, not
// failing, and is not cut again for a while. So a stream that is always
// slower than the others of its batches (one far away) is not cut, and
// retried, batch after batch.
func (s *Sink) watchCut(subject string, fs []jetstream.PubAckFuture) {
	for _, f := range fs {
		select {
		case ack := <-f.Ok():
			stream := ""
			if ack != nil {
				stream = ack.Stream
			}
			if !s.noteSlow(subject, stream) {
				return
			}
			s.log.Info("nats sink: a target subject acknowledged a publish after the grace that followed its batch's last answer; deliveries to it (and to its stream's other subjects) wait for their PubAcks up to publish_timeout for a while",
				zap.String("subject", subject), zap.String("stream", stream), zap.Duration("for", s.cfg.NoStreamTTL))
			return
		case <-f.Err():
		}
	}
}

var (
	_ shard.Sink      = (*Sink)(nil)
	_ bridge.Healther = (*Sink)(nil)
)

// NewSink returns a Sink publishing on nc.
func NewSink(nc *natsgo.Conn, cfg Config) (*Sink, error) {
	cfg.setDefaults()
	// The window bounds each Deliver call; the library-wide cap only has to
	// be out of the way of several shards delivering at once.
	// A PubAck that never comes (a subject with core subscribers, a lost
	// reply) must not stay pending in the library forever.
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(1<<16), jetstream.WithPublishAsyncTimeout(cfg.PublishTimeout))
	if err != nil {
		return nil, fmt.Errorf("nats sink: jetstream context: %w", err)
	}
	s := &Sink{
		nc:  nc,
		js:  js,
		cfg: cfg,
		log: cfg.Logger,
		// No retries on "no responders": the Sink asks itself whether a
		// stream captures the subject, instead of waiting 2x250ms for
		// every such subject.
		pubOpts:   []jetstream.PublishOpt{jetstream.WithRetryAttempts(0), jetstream.WithStallWait(cfg.PublishTimeout)},
		probeWait: min(defaultProbeWait, cfg.PublishTimeout/2),
		verdicts:  map[string]verdict{},
		now:       time.Now,
		denied:    map[string]time.Time{},

		noAckStreams: map[string]noAckVerdict{},
		slowOK:       map[string]time.Time{},
		streamOf:     map[string]string{},
		epoch:        time.Now(),
	}
	s.ping = func(ctx context.Context) bool {
		_, err := s.js.AccountInfo(ctx)
		return err == nil
	}
	prev := nc.ErrorHandler()
	nc.SetErrorHandler(func(c *natsgo.Conn, sub *natsgo.Subscription, err error) {
		s.noteAsyncError(err)
		if prev != nil {
			prev(c, sub, err)
		}
	})
	return s, nil
}

// Health is nil while the connection is up.
func (s *Sink) Health() error { return connErr(s.nc) }

// DeliveryID is the Nats-Msg-Id of a delivery:
//
//	<transport>:<source>|<id>|<due>
//
// the task's source (the transport and delay topic or stream it came
// from: ids are scoped to their source), its id and its delay-due, so a
// redelivery of the same firing is a duplicate, while a later firing of
// the same id, or the same id and due from another source, is not. A dead
// letter has its origin in place of the id: it is one source message's,
// and two messages with the same id and due (a publish-failed dead letter
// replayed with its delay-at that fails again) are two dead letters, of
// which the DLQ stream's duplicate window must drop neither. In source,
// id and due, '%', '|', space and the ASCII control characters are
// percent-encoded (%XX): the three fields never contain a raw '|', so
// distinct (source, id, due) never give the same string, and nats.go,
// which trims white space from header values and turns CR and LF into
// spaces, finds nothing to alter.
func DeliveryID(t *codec.Task) string {
	id := t.ID
	if id == "" || t.Kind == codec.KindDeadLetter {
		id = t.Origin
	}
	var due string
	found := false
	for _, h := range t.Headers {
		if strings.EqualFold(h.Key, codec.HeaderDue) {
			due, found = string(h.Value), true
			break
		}
	}
	if !found {
		due = time.UnixMilli(t.Due).UTC().Format(dueLayout)
	}
	// The dead-letter destination is on the source's own transport.
	tr := t.DLQTransport.String()
	var b strings.Builder
	b.Grow(len(tr) + len(t.Source) + len(id) + len(due) + 3)
	b.WriteString(tr)
	b.WriteByte(':')
	writeIDField(&b, t.Source)
	b.WriteByte('|')
	writeIDField(&b, id)
	b.WriteByte('|')
	writeIDField(&b, due)
	return b.String()
}

// writeIDField writes s to b with '%', '|', space, the ASCII control
// characters and DEL percent-encoded.
func writeIDField(b *strings.Builder, s string) {
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c <= ' ' || c == 0x7f || c == '%' || c == '|':
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&15])
		default:
			b.WriteByte(c)
		}
	}
}

// verdict returns what is known about subject, if it still stands.
func (s *Sink) verdict(subject string) (verdict, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.verdicts[subject]
	if ok && !s.now().Before(v.until) {
		delete(s.verdicts, subject)
		return verdict{}, false
	}
	return v, ok
}

// setVerdict records for NoStreamTTL whether subject is core NATS.
func (s *Sink) setVerdict(subject string, core bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	if len(s.verdicts) >= maxVerdicts {
		for k, v := range s.verdicts {
			if !now.Before(v.until) {
				delete(s.verdicts, k)
			}
		}
		if len(s.verdicts) >= maxVerdicts/2 {
			// Forget the stream verdicts first: the next publish to such
			// a subject finds out again from its PubAck, at no cost. A
			// core verdict costs a probeWait or a stream lookup to find
			// out again (found by a many-targets hunt: 8 of 59 batches
			// waited 1 s once the cache was cleared whole).
			for k, v := range s.verdicts {
				if !v.core {
					delete(s.verdicts, k)
				}
			}
		}
		if len(s.verdicts) >= maxVerdicts/2 {
			// Mostly live verdicts (more target subjects within
			// NoStreamTTL than the cache holds): start over, as denied
			// and noAckStreams do, rather than grow past the bound and
			// walk the whole map under s.mu for every new subject. A
			// forgotten subject is only asked about again.
			clear(s.verdicts)
		}
	}
	s.verdicts[subject] = verdict{core: core, until: now.Add(s.cfg.NoStreamTTL)}
}

// noStream records that no stream captures subject, for NoStreamTTL,
// unless a verdict stands already.
func (s *Sink) noStream(known map[string]verdict, subject string) {
	if v, ok := known[subject]; ok && v.core {
		return
	}
	s.setVerdict(subject, true)
	known[subject] = verdict{core: true}
}

// lookupStream asks the server which stream of the account captures
// subject ($JS.API.STREAM.NAMES with a subject filter: the server's own
// subject match), within streamLookupTimeout. found is false with a nil
// error when none does. A failed lookup is not repeated for NoStreamTTL.
func (s *Sink) lookupStream(ctx context.Context, subject string) (name string, found bool, err error) {
	s.mu.Lock()
	now := s.now()
	if s.lookupErr != nil && now.Before(s.lookupUntil) {
		err := s.lookupErr
		s.mu.Unlock()
		return "", false, err
	}
	s.mu.Unlock()

	lctx, cancel := context.WithTimeout(ctx, min(streamLookupTimeout, s.cfg.PublishTimeout))
	name, err = s.js.StreamNameBySubject(lctx, subject)
	cancel()
	switch {
	case err == nil:
		return name, true, nil
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return "", false, nil
	case ctx.Err() != nil:
		return "", false, ctx.Err()
	}
	err = fmt.Errorf("stream lookup ($JS.API.STREAM.NAMES) failed: %w", err)
	s.log.Warn("nats sink: cannot tell which target subjects have a stream; deliveries that find no stream wait until a lookup succeeds",
		zap.Duration("next_lookup_in", s.cfg.NoStreamTTL), zap.Error(err))
	s.mu.Lock()
	s.lookupErr, s.lookupUntil = err, now.Add(s.cfg.NoStreamTTL)
	s.mu.Unlock()
	return "", false, err
}

// noAck reports whether stream is configured with no_ack (it stores
// publishes but never acknowledges one). The answer, or a failure to get
// it (false), stands for NoStreamTTL, so PubAck timeouts during a
// JetStream outage do not add a stream info request each.
func (s *Sink) noAck(ctx context.Context, stream string) bool {
	s.mu.Lock()
	if v, ok := s.noAckStreams[stream]; ok && s.now().Before(v.until) {
		s.mu.Unlock()
		return v.noAck
	}
	s.mu.Unlock()
	lctx, cancel := context.WithTimeout(ctx, min(streamLookupTimeout, s.cfg.PublishTimeout))
	st, err := s.js.Stream(lctx, stream)
	cancel()
	noAck := err == nil && st.CachedInfo().Config.NoAck
	if ctx.Err() != nil {
		return noAck // the caller gave up: no answer to keep
	}
	s.mu.Lock()
	if len(s.noAckStreams) >= maxNoted {
		clear(s.noAckStreams)
	}
	s.noAckStreams[stream] = noAckVerdict{noAck: noAck, until: s.now().Add(s.cfg.NoStreamTTL)}
	s.mu.Unlock()
	return noAck
}

// noAckVerdict is what Sink.noAck found out about a stream.
type noAckVerdict struct {
	noAck bool
	until time.Time
}

// Deliver publishes the batch: JetStream async publishes with at most
// PublishWindow in flight, then waits for every PubAck (at most
// PublishTimeout). errs[i] is nil when batch[i] was acknowledged (or, with
// Config.CoreTargets, for a target subject without a stream, published and
// flushed).
//
// Every subject is published with JetStream first: only the server knows
// whether a stream captures it (through subject mappings, imports and
// domains too). Where the server confirms that no stream does (see the
// package documentation), the task fails with ErrNoTargetStream, or, for a
// target with Config.CoreTargets, goes out with core NATS; either is
// decided directly for NoStreamTTL.
func (s *Sink) Deliver(ctx context.Context, batch []*codec.Task) []error {
	if len(batch) == 0 {
		return nil
	}
	start, began := time.Now(), s.now()
	errs := make([]error, len(batch))
	failed := false
	fail := func(i int, err error) {
		errs[i] = err
		failed = true
	}
	if err := connErr(s.nc); err != nil {
		for i := range batch {
			fail(i, fmt.Errorf("nats sink: publish to %q: %w: %w", batch[i].Target, shard.ErrUnavailable, err))
		}
		return errs
	}
	dctx, cancel := context.WithTimeout(ctx, s.cfg.PublishTimeout)
	defer cancel()
	pctx, pcancel := context.WithTimeout(dctx, s.probeWait)
	defer pcancel()

	msgs := make([]*natsgo.Msg, len(batch))
	futs := make([]jetstream.PubAckFuture, len(batch))
	probe := make([]bool, len(batch))    // the subject's kind is not known
	var core []int                       // to publish with core NATS
	var flushed []int                    // published, done once flushed
	var noResp []int                     // JetStream had no responders
	var quiet []int                      // probes without a PubAck within probeWait
	var foreign = map[int]error{}        // quiet ones answered, but not by a stream
	window := make([]int, 0, len(batch)) // published, in order; window[head:] in flight
	head := 0
	known := map[string]verdict{} // per batch: targets repeat
	verdictOf := func(subject string) (verdict, bool) {
		v, ok := known[subject]
		if !ok {
			if v, ok = s.verdict(subject); ok {
				known[subject] = v
			}
		}
		return v, ok
	}

	// Answers taken from a future's channels before batch[i] is waited
	// for (a channel gives its value once): got[i], and gotErr[i].
	got := make([]bool, len(batch))
	gotErr := make([]error, len(batch))
	// lastAnswer is when a PubAck of the batch was last seen (zero: none
	// yet), heard the subjects that acknowledged a publish of it,
	// heardStream the streams that did, and acked the stream of each
	// subject heard (for Sink.streamOf); answers are seen when waited
	// for, or by progress. An error is no sign that a subject's stream
	// acknowledges: the retry of a publish cut from a stuck stream is
	// answered at once "duplicate message id is in process" (review R188).
	var lastAnswer time.Time
	heard := map[string]bool{}
	heardStream := map[string]bool{}
	acked := map[string]string{}
	took := func(i int, ack *jetstream.PubAck, err error) {
		got[i], gotErr[i] = true, err
		if err != nil {
			return
		}
		lastAnswer = time.Now()
		s.lastAck.Store(int64(lastAnswer.Sub(s.epoch)))
		if t := batch[i].Target; !heard[t] {
			heard[t] = true
			if ack != nil && ack.Stream != "" {
				heardStream[ack.Stream] = true
				acked[t] = ack.Stream
			}
		}
	}
	// answer takes batch[i]'s answer if it is there.
	answer := func(i int) bool {
		if !got[i] {
			select {
			case ack := <-futs[i].Ok():
				took(i, ack, nil)
			case err := <-futs[i].Err():
				took(i, nil, err)
			default:
			}
		}
		return got[i]
	}
	// silent reports whether nothing of subject's has acknowledged a
	// publish of the batch: neither the subject nor the stream that last
	// acknowledged one to it (a stream capturing many subjects answers at
	// its own pace, whichever subject it was).
	silent := func(subject string) bool {
		if heard[subject] {
			return false
		}
		s.mu.Lock()
		stream, ok := s.streamOf[subject]
		s.mu.Unlock()
		return !ok || !heardStream[stream]
	}
	// Stragglers: a publish to a subject that has acknowledged nothing in
	// the batch (nor has the stream that last acknowledged a publish to
	// it, see silent), while other publishes have their PubAcks, is
	// waited for a grace only (stragglerGrace of the time from the
	// batch's start to its last PubAck, counted from that PubAck or from
	// the publish's send if later), then it fails as a PubAck timeout (so
	// an outage, unless its subject is denied or its stream no_ack; see
	// the end of Deliver). Waiting PublishTimeout for it held every other
	// task of the batch, delivered already, as long: a stream leader that
	// lost its quorum takes publishes without acknowledging them until it
	// steps down (~20 s; hunts H182, H184). Every task of the batch for
	// such a stream is cut so, however many (review R185), and so is one
	// waited for while the window is full. A retry carries the same
	// Nats-Msg-Id, so if a cut publish is stored after all, the stream's
	// duplicate window drops the retry (as after a PubAck timeout; a
	// retry while the first is still proposed is answered "duplicate
	// message id is in process", an outage too). Never cut: a publish to
	// a subject, or a stream, that acknowledged another publish of the
	// batch (a stream whose answers come in bursts, reviews R186, R188),
	// a publish of a batch without a PubAck yet while no other batch got
	// one since it was sent either (a slow cluster; errors such as "no
	// responders" answer fast and say nothing of a stream's pace; a batch
	// of one goes by Sink.lastAck, another lane's PubAck, with the least
	// grace), a probe within its probeWait, or a subject slowSubject says
	// answers late but works. A probe whose subject the lookup finds a stream for
	// is waited again, and that wait is cut.
	settled := make([]bool, len(batch))
	// sent[i]: when the publishes from batch[i] on were sent, if after a
	// wait for the window (zero: at the start). A publish is not cut
	// before the grace has passed since it was sent either.
	sent := make([]time.Time, len(batch))
	var resumed time.Time
	// progress takes the answers that came to publishes of the batch
	// not waited for yet. Called only after a wait's first poll, so a
	// healthy batch, whose answers are there or come within a poll, does
	// not scan the window per publish.
	progress := func() {
		for _, j := range window {
			if !settled[j] {
				answer(j)
			}
		}
	}
	cuts := map[string][]jetstream.PubAckFuture{} // per subject, for watchCut
	pinged := false                               // see pingJS

	// wait waits for the PubAck of batch[i]; a probe only probeWait, unless
	// a stream acknowledged another publish to the subject meanwhile.
	wait := func(i int, probing bool) {
		defer func() { settled[i] = true }()
		f := futs[i]
		var pdone <-chan struct{}
		if v, ok := known[batch[i].Target]; probing && (!ok || v.core) {
			pdone = pctx.Done()
		}
		subject := batch[i].Target
		// slow: its subject answers late but works; not cut, but seen
		// late (past the grace) again.
		slow := pdone == nil && s.slowSubject(subject)
		late, polled := false, false
		// An answer that is there wins over a deadline.
		for !answer(i) {
			var tm *time.Timer
			var tick <-chan time.Time
			gaveUp := false
			if pdone == nil && !late {
				if polled {
					progress()
				}
				polled = true
				d := stragglerPoll
				ref, grace := lastAnswer, time.Duration(0)
				sentAt := later(start, sent[i])
				if !ref.IsZero() {
					grace = stragglerGrace(ref.Sub(start))
				} else if s.knownStream(subject) {
					// No PubAck in the batch (a batch of one). If
					// another lane's came since this was sent, or the
					// JetStream API answered a ping sent once this
					// waited the least grace, the servers answer, not
					// this subject's stream. Only for a subject a
					// stream acknowledged before: a new one (a key of
					// its own) of a stream far away would be cut each
					// time (review R190).
					if la := s.lastAck.Load(); la > int64(sentAt.Sub(s.epoch)) {
						ref, grace = s.epoch.Add(time.Duration(la)), stragglerGraceMin
					} else if !pinged && time.Since(sentAt) >= stragglerGraceMin {
						pinged = true
						go s.pingJS(dctx)
					}
				}
				if !ref.IsZero() && silent(subject) {
					d = min(d, time.Until(later(ref, sent[i]).Add(grace)))
					if d <= 0 && !slow {
						fail(i, fmt.Errorf("%w: publish to %q: no PubAck to the subject %s after the last PubAck",
							ErrPublishTimeout, subject, grace))
						cuts[subject] = append(cuts[subject], f)
						return
					}
					late = d <= 0
				}
				if !late {
					tm = time.NewTimer(d)
					tick = tm.C
				}
			}
			select {
			case ack := <-f.Ok():
				took(i, ack, nil)
			case err := <-f.Err():
				took(i, nil, err)
			case <-dctx.Done():
				fail(i, s.ctxErr(ctx, batch[i].Target))
				gaveUp = true
			case <-pdone:
				quiet = append(quiet, i)
				gaveUp = true
			case <-tick:
			}
			if tm != nil {
				tm.Stop()
			}
			if gaveUp {
				return
			}
		}
		if late && gotErr[i] == nil {
			s.noteSlow(batch[i].Target, acked[batch[i].Target]) // it still is
		}
		err := gotErr[i]
		switch {
		case err == nil:
			if probe[i] {
				s.setVerdict(batch[i].Target, false)
				known[batch[i].Target] = verdict{}
			}
		case errors.Is(err, jetstream.ErrNoStreamResponse):
			noResp = append(noResp, i)
		case pdone != nil && errors.Is(err, jetstream.ErrInvalidJSAck):
			// A core subscriber answered the request (a service).
			quiet, foreign[i] = append(quiet, i), err
		default:
			fail(i, fmt.Errorf("nats sink: publish to %q: %w", batch[i].Target, err))
		}
	}

	for i, t := range batch {
		if t.Transport != codec.TransportNATS {
			fail(i, fmt.Errorf("%w: %s to %q", ErrWrongTransport, t.Transport, t.Target))
			continue
		}
		if len(t.Target) > codec.MaxSubjectLen {
			// Stored before Parse bounded subjects: published, its
			// control line could pass the server's max_control_line,
			// which closes the connection the source shares.
			fail(i, fmt.Errorf("nats sink: subject %.64q... is longer than %d bytes", t.Target, codec.MaxSubjectLen))
			continue
		}
		msgs[i] = &natsgo.Msg{Subject: t.Target, Data: t.Value, Header: headersOut(t.Headers, DeliveryID(t), t.DLQTransport)}
		v, ok := verdictOf(t.Target)
		if ok && v.core {
			if !s.coreOK(t) {
				fail(i, noStreamErr(t))
				continue
			}
			core = append(core, i)
			continue
		}
		probe[i] = !ok
		if len(window)-head >= s.cfg.PublishWindow {
			wait(window[head], probe[window[head]])
			head++
			resumed = time.Now()
		}
		sent[i] = resumed
		f, err := s.js.PublishMsgAsync(msgs[i], s.pubOpts...)
		if err != nil {
			fail(i, fmt.Errorf("nats sink: publish to %q: %w", t.Target, err))
			continue
		}
		futs[i] = f
		window = append(window, i)
	}
	for _, i := range window[head:] {
		wait(i, probe[i])
	}

	// Probes no stream acknowledged in time: a subject with core
	// subscribers (they got the message; nobody acknowledges it, or a
	// service answered something else) or a slow stream. If no stream
	// captures the subject, the publish was a core one.
	type lookedUp struct {
		stream string // "": none captures it
		err    error
	}
	lookups := map[string]lookedUp{} // per subject
	streamOf := func(subject string) (string, error) {
		l, ok := lookups[subject]
		if !ok {
			name, _, err := s.lookupStream(ctx, subject)
			l = lookedUp{stream: name, err: err}
			lookups[subject] = l
		}
		return l.stream, l.err
	}
	// lookup is nil when no stream captures subject.
	lookup := func(subject string) error {
		name, err := streamOf(subject)
		if err == nil && name != "" {
			err = fmt.Errorf("stream %q captures it", name)
		}
		return err
	}
	for _, i := range quiet {
		if v, ok := known[batch[i].Target]; !(ok && !v.core) && lookup(batch[i].Target) == nil {
			select {
			case <-futs[i].Ok(): // just in time after all
				s.setVerdict(batch[i].Target, false)
				continue
			default:
			}
			if !s.coreOK(batch[i]) {
				// Core subscribers may have got it; nothing stored it.
				s.noStream(known, batch[i].Target)
				fail(i, noStreamErr(batch[i]))
				continue
			}
			flushed = append(flushed, i)
			continue
		}
		if err, ok := foreign[i]; ok {
			fail(i, fmt.Errorf("nats sink: publish to %q: %w", batch[i].Target, err))
			continue
		}
		wait(i, false)
	}
	for subject, fs := range cuts {
		go s.watchCut(subject, fs)
	}
	if len(acked) > 0 {
		s.mu.Lock()
		for subject, stream := range acked {
			s.noteStreamLocked(subject, stream)
		}
		s.mu.Unlock()
	}

	// "No responders": no stream took the message. Core NATS only where
	// the server confirms that no stream captures the subject; otherwise
	// (a stream in a leader election, JetStream down, a failed lookup) the
	// task waits like in an outage.
	for _, i := range noResp {
		subj := batch[i].Target
		if v, ok := verdictOf(subj); ok && !v.core {
			fail(i, fmt.Errorf("nats sink: publish to %q: %w (a stream acknowledged publishes to the subject less than %s ago)",
				subj, jetstream.ErrNoStreamResponse, s.cfg.NoStreamTTL))
			continue
		}
		if err := lookup(subj); err != nil {
			fail(i, fmt.Errorf("nats sink: publish to %q: %w (%w)", subj, jetstream.ErrNoStreamResponse, err))
			continue
		}
		if !s.coreOK(batch[i]) {
			s.noStream(known, subj)
			fail(i, noStreamErr(batch[i]))
			continue
		}
		core = append(core, i)
	}

	for _, i := range core {
		if err := s.nc.PublishMsg(msgs[i]); err != nil {
			fail(i, fmt.Errorf("nats sink: core publish to %q: %w", batch[i].Target, err))
			continue
		}
		flushed = append(flushed, i)
	}
	if len(flushed) > 0 {
		// A budget of its own: a stream lookup may have used the PubAck one.
		fctx, fcancel := context.WithTimeout(ctx, s.cfg.PublishTimeout)
		err := s.nc.FlushWithContext(fctx)
		fcancel()
		if err != nil {
			if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
				err = fmt.Errorf("%w: flush after %s: %w", ErrPublishTimeout, s.cfg.PublishTimeout, err)
			}
			for _, i := range flushed {
				fail(i, fmt.Errorf("nats sink: core publish to %q: flush: %w", batch[i].Target, err))
			}
		} else {
			for _, i := range flushed {
				if _, ok := verdictOf(batch[i].Target); !ok {
					s.setVerdict(batch[i].Target, true)
					known[batch[i].Target] = verdict{core: true}
				}
			}
			s.cfg.Metrics.BestEffort.WithLabelValues(codec.TransportNATS.String()).Add(float64(len(flushed)))
		}
	}

	s.cfg.Metrics.PublishSeconds.WithLabelValues(codec.TransportNATS.String()).Observe(time.Since(start).Seconds())
	if !failed {
		return nil
	}
	corePub := make(map[int]bool, len(flushed)) // core publishes: no PubAck to wait for
	for _, i := range flushed {
		corePub[i] = true
	}
	// noAckStreamOf names the stream capturing batch[i]'s subject if it is
	// no_ack, for a JetStream publish whose PubAck did not come. Not asked
	// for a subject a stream acknowledged within NoStreamTTL (a no_ack
	// stream never does): an outage then costs no lookups.
	noAckStreamOf := func(i int, err error) string {
		if corePub[i] || !(errors.Is(err, ErrPublishTimeout) || errors.Is(err, jetstream.ErrAsyncPublishTimeout)) {
			return ""
		}
		if v, ok := verdictOf(batch[i].Target); ok && !v.core {
			return ""
		}
		if name, lerr := streamOf(batch[i].Target); lerr == nil && name != "" && s.noAck(ctx, name) {
			return name
		}
		return ""
	}
	for i, err := range errs {
		switch {
		case err == nil || errors.Is(err, shard.ErrUnavailable) || errors.Is(err, shard.ErrRefused):
		case refused(err):
			errs[i] = fmt.Errorf("%w: %w", shard.ErrRefused, err)
		case s.deniedSince(batch[i].Target, began):
			// Not an outage: the server refused the bridge's user this
			// subject, so the attempt counts (publish-failed at the end
			// of the retry policy) rather than wait forever.
			errs[i] = fmt.Errorf("nats sink: publish to %q: %w (the server refused the bridge's user this subject; see its publish permissions): %v",
				batch[i].Target, natsgo.ErrPermissionViolation, err)
		case ctx.Err() == nil && unavailable(err):
			if stream := noAckStreamOf(i, err); stream != "" {
				// Not an outage: such a stream never acknowledges, so the
				// attempt counts rather than wait (and store a copy) forever.
				errs[i] = fmt.Errorf("nats sink: publish to %q: stream %q is configured with no_ack, so no publish to it is ever acknowledged: %v",
					batch[i].Target, stream, err)
				break
			}
			errs[i] = fmt.Errorf("%w: %w", shard.ErrUnavailable, err)
		}
	}
	return errs
}

// refused reports whether a publish failed because of the message itself,
// so that its subject will never take it as is: larger than the server's
// max_payload (the client refuses it, nats.ErrMaxPayload) or than its
// stream's max_msg_size (JetStream error 10054), or than the stream's
// file store can hold (10077, "message too large"), or with a header
// block over JetStream's 64 KiB (10097, whatever the stream's limits: a
// dead letter's added headers can take a source message just under it
// over). A stream that is full
// (its limits with DiscardNew), an account out of JetStream resources and
// a subject no stream captures are not: they heal when the operator fixes
// the stream.
func refused(err error) bool {
	if errors.Is(err, natsgo.ErrMaxPayload) {
		return true
	}
	var api *jetstream.APIError
	if !errors.As(err, &api) {
		return false
	}
	switch api.ErrorCode {
	case jsErrMessageExceedsMaximum, jsErrHeaderExceedsMaximum:
		return true
	case jsErrStreamStoreFailed:
		return strings.ToLower(api.Description) == "message too large"
	}
	return false
}

// unavailable reports whether a publish failed for want of a working server
// rather than because of the message or its stream: no connection, no
// PubAck in time, no responder for a subject that has a stream (a leader
// election, JetStream down), JetStream answering 503 for itself, or an
// earlier publish of the same message still in process. A
// stream's refusal (limits, expected sequence, a bad header) is the task's
// own, although the server answers some of those with 503 too.
func unavailable(err error) bool {
	for _, e := range []error{
		ErrDisconnected, ErrPublishTimeout, natsgo.ErrConnectionClosed, natsgo.ErrDisconnected,
		natsgo.ErrConnectionReconnecting, natsgo.ErrConnectionDraining, natsgo.ErrTimeout,
		natsgo.ErrNoResponders, jetstream.ErrNoStreamResponse, jetstream.ErrAsyncPublishTimeout, jetstream.ErrJetStreamNotEnabled,
		jetstream.ErrJetStreamNotEnabledForAccount, context.DeadlineExceeded,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	var api *jetstream.APIError
	if !errors.As(err, &api) {
		return false
	}
	return (api.Code == 503 && !streamRefusal(api)) || api.ErrorCode == jsErrDuplicateInProcess
}

// JetStream error codes the server answers a publish with, code 503, when
// the stream refuses the message rather than cannot take it now.
const (
	jsErrStreamStoreFailed     = 10077 // its limits with DiscardNew, or its storage failing
	jsErrStreamSequenceNoMatch = 10063 // an expected sequence
	jsErrInsufficientResources = 10023 // the account's or server's storage limits
	// jsErrMessageExceedsMaximum (code 400) is the stream's max_msg_size.
	jsErrMessageExceedsMaximum = 10054
	// jsErrHeaderExceedsMaximum (code 400): a header block over 65535
	// bytes, which no stream takes.
	jsErrHeaderExceedsMaximum = 10097
	// jsErrDuplicateInProcess (code 409): an earlier publish with this
	// Nats-Msg-Id is still being proposed (a stream leader waiting for
	// its quorum), so whether it is stored is not known yet. Not the
	// task's fault: it waits as in an outage, and its next publish is
	// acknowledged as a duplicate once the first is stored. Charged as
	// an attempt, it dead-lettered valid tasks as publish-failed during a
	// cluster's quorum loss (while their first publish was then stored).
	jsErrDuplicateInProcess = 10158
)

// streamRefusal reports whether a 503 answer is the stream refusing the
// message. A store failure is one only when it names a limit (the
// server's ErrMaxMsgs, ErrMaxBytes, ErrMaxMsgsPerSubject, ErrMsgTooLarge);
// a closed store or a disk error is JetStream not working.
func streamRefusal(api *jetstream.APIError) bool {
	switch api.ErrorCode {
	case jsErrStreamSequenceNoMatch, jsErrInsufficientResources:
		return true
	case jsErrStreamStoreFailed:
		d := strings.ToLower(api.Description)
		return strings.HasPrefix(d, "maximum ") || d == "message too large"
	}
	return false
}

// coreOK reports whether t may go out with core NATS when no stream
// captures its subject: a target with Config.CoreTargets, never a dead
// letter (it is the last copy of its message).
func (s *Sink) coreOK(t *codec.Task) bool {
	return s.cfg.CoreTargets && t.Kind != codec.KindDeadLetter
}

// noStreamErr is the failure of a task whose subject no stream captures
// and that may not go out with core NATS.
func noStreamErr(t *codec.Task) error {
	if t.Kind == codec.KindDeadLetter {
		return fmt.Errorf("nats sink: dead letter: %w %q; create one (dead letters are never published with core NATS)", ErrNoTargetStream, t.Target)
	}
	return fmt.Errorf("nats sink: %w %q; create one or set nats.core_targets", ErrNoTargetStream, t.Target)
}

func (s *Sink) ctxErr(ctx context.Context, target string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("nats sink: publish to %q: %w", target, err)
	}
	return fmt.Errorf("%w: publish to %q after %s", ErrPublishTimeout, target, s.cfg.PublishTimeout)
}
