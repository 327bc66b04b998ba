package nats

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/shard"
)

// How often, at most, the source asks the server for the consumer's ack
// floor while a barrier holds its checkpoint back (see floorState).
const barrierCheckEvery = 500 * time.Millisecond

// Source reads the delay subjects of one stream through a durable pull
// consumer. It implements bridge.Source and bridge.Healther.
//
// Messages are consumed with pull requests the source issues itself (see
// puller), outstanding so the next batch is already buffered while the
// handler makes the current one durable. A batch is the first message
// available plus whatever else arrives within Config.Linger, up to
// Config.BatchSize.
//
// Acks are explicit, one per message, fire-and-forget (msg.Ack publishes
// without waiting for a reply): they pipeline on the connection, so a batch
// costs no round trip. An ack lost on the way is harmless: the message is
// redelivered after AckWait and skipped by the checkpoint, or by the spans
// held above it while a barrier holds it back (see floorState.spans).
// Taken in again, it would be a new task if the first one was delivered
// and deleted meanwhile, and delivered twice. AckAll
// with one synchronous ack would also work, but it acks everything below
// the last sequence, including redeliveries that arrive out of order and
// have not been handled yet.
type Source struct {
	nc  *natsgo.Conn
	js  jetstream.JetStream
	cfg Config
	log *zap.Logger
	lag prometheus.Gauge // delaybridge_source_lag_messages of the stream
	// caughtUp is closed once the consumer has nothing pending (CaughtUp).
	caughtUp bridge.Signal
	// base is the checkpoint key without the stream's identity; key (Run's
	// goroutine only) the one of the stream Run reads: see CheckpointKey.
	base string
	key  string
	// inc (Run's goroutine only) is the incarnation of the stream Run
	// reads, created at incOf (see settleIncarnation); incKey where it is
	// stored. incDue, when not 0, is the creation time of a stream whose
	// incarnation is not settled yet, because a floor of an older version
	// without the stream's identity decides it (see consume).
	inc    uint32
	incOf  int64
	incDue int64
	incKey string

	consumer atomic.Pointer[consumerRef]
	consErr  atomic.Pointer[error]
	// otherBridgesChecked: the first Run looked for other bridges'
	// consumers (warnOtherBridgeConsumers).
	otherBridgesChecked atomic.Bool
	// The stream's identity (creation time, Unix ns) and last sequence as
	// ensure last saw them: a stream deleted and created again numbers
	// its messages from 1, so a floor from before says nothing about it.
	created atomic.Int64
	lastSeq atomic.Uint64
	// ackWait is how long the server waits for an ack before it
	// redelivers, per the consumer as the server has it (AckWait, or the
	// shortest BackOff step): the keep-alive period derives from it.
	ackWait atomic.Int64
	// noNaks (tests only) leaves the deliveries never received to
	// AckWait, as when the naks of nakUnseen are lost.
	noNaks bool
	// foreignLog throttles the warning about another client taking the
	// consumer's deliveries; lastReset (Run's goroutine only) is when the
	// pulls last started anew (see checkGaps).
	foreignLog logthrottle.Throttle
	lastReset  time.Time
	// stopLog throttles "consuming stopped" (Run's goroutine only): a
	// consume that fails at every retry (a consumer without a leader
	// answers its info 503 at once, every 2 s in a quorum loss) is
	// logged at its first stop and then once per 30 s for the same
	// error, with the count held back. A batch taken in, or a pull the
	// server answers on an idle stream, ends the run (stopRun: a stop
	// since the last end) with "consuming again" (hunt H204: the log said
	// the source stopped, and never that it went on), as stopEp lets it:
	// at once after a logged stop line, else once per interval
	// (logthrottle.Episode). The end does not restart stopLog (review
	// R210: it did, so a consume stopping and going on by turns, a
	// flaky link missing heartbeats, logged a stop and an end per turn).
	// stopNow: nil is time.Now (tests set it).
	stopLog logthrottle.Throttle
	stopEp  logthrottle.Episode
	stopRun bool
	stopNow func() time.Time
	// handleLog throttles handle's line per shape of the error: a store
	// that refuses writes (a failed fsync, the volume's reserve) fails
	// the batch at every retry, 6 lines a minute once the backoff reaches
	// 10 s (hunt H204). handleEp decides the end line of a run of
	// failures (a batch stored, maybe the next after a restarted
	// consume): at once if a failure line was logged since the last end
	// line, else one per interval (logthrottle.Episode); the end line
	// does not restart handleLog (review R210: it did, since 88b29ae, so
	// a store refusing each batch once logged a failure and an end per
	// batch). handleTries (handle's caller, Run's goroutine, only): the
	// run's failed tries of every batch (review F211: only the last
	// batch's were counted, those of a batch given back when Run stopped
	// lost).
	handleLog   logthrottle.Throttle
	handleEp    logthrottle.Episode
	handleTries int
	// noSourceLog throttles the line about a message on a subject no
	// source reads (a consumer filter widened by an operator): it was
	// logged per message (hunt H204), then per subject, up to 65 lines
	// per 30 s with a subject per entity (review R200). One condition:
	// the line names the first subject and counts the messages held back.
	noSourceLog logthrottle.Throttle
	// catchFloor (set by Run's goroutine): the delivered sequence, at a
	// consume's start before the source caught up, of a consumer with
	// deliveries not yet acknowledged; the source is caught up only once
	// the ack floor has reached it (see atEnd). ackWatch is set while a
	// goroutine waits for that.
	catchFloor atomic.Int64
	ackWatch   atomic.Bool
	// resent counts the JetStream API requests of the set-up sent again
	// because no answer came in time (see answered); tests read it.
	resent atomic.Int64

	mu      sync.Mutex
	cancel  context.CancelFunc
	running chan struct{}
	closed  bool
}

type consumerRef struct{ c jetstream.Consumer }

var _ bridge.Source = (*Source)(nil)
var _ bridge.Healther = (*Source)(nil)
var _ bridge.CatchingUp = (*Source)(nil)

// CaughtUp is closed once the consumer was found with no message pending
// (at its start, with none awaiting acknowledgement either, or in the
// metadata of the last message of a batch, once that batch is stored),
// and with every message delivered before the source started
// acknowledged (see atEnd): what the stream held when the bridge started
// has been read. Those delivered before and not acknowledged (a previous
// run's in flight at a crash) are asked back at start (nakUnseen).
func (s *Source) CaughtUp() <-chan struct{} { return s.caughtUp.C() }

// atEnd is called when a stored batch left nothing pending. Messages
// delivered before the consume started and not acknowledged (a previous
// run's in flight at a crash, asked back at start) are queued for
// redelivery, which the pending count leaves out: the source is caught up
// once the consumer's ack floor has also reached catchFloor, which a
// goroutine polls for (the acks of the batch just stored are on their way,
// and no batch may come after it). It ends with ctx, or once CaughtUp is
// closed; the next batch at the end starts another. A stream created
// again or restored drops catchFloor.
func (s *Source) atEnd(ctx context.Context, cons jetstream.Consumer) {
	if s.caughtUp.Closed() {
		return
	}
	if s.catchFloor.Load() == 0 || cons == nil {
		s.reachedEnd()
		return
	}
	if !s.ackWatch.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer s.ackWatch.Store(false)
		t := time.NewTicker(ackFloorPoll)
		defer t.Stop()
		for {
			// Read at each poll: a later consume may have raised it.
			if info, err := cons.Info(ctx); err == nil && int64(info.AckFloor.Stream) >= s.catchFloor.Load() {
				s.reachedEnd()
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-s.caughtUp.C(): // closed otherwise (catchFloor dropped)
				return
			case <-t.C:
			}
		}
	}()
}

// ackFloorPoll is how often atEnd's goroutine reads the consumer's ack
// floor.
var ackFloorPoll = 50 * time.Millisecond

func (s *Source) reachedEnd() {
	if !s.caughtUp.Closed() {
		s.log.Info("nats source: caught up: no message pending")
		s.caughtUp.Close()
	}
}

// NewSource checks (or with cfg.Create, creates) the delay stream and the
// durable consumer. Without Create a missing stream or consumer is an error
// wrapping ErrNoStream or ErrNoConsumer that names it.
func NewSource(nc *natsgo.Conn, cfg Config) (*Source, error) {
	cfg.setDefaults()
	if err := cfg.validateSource(); err != nil {
		return nil, fmt.Errorf("nats source: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("nats source: jetstream context: %w", err)
	}
	s := &Source{
		nc:  nc,
		js:  js,
		cfg: cfg,
		log: cfg.Logger.With(zap.String("stream", cfg.Stream), zap.String("consumer", cfg.Consumer)),
		lag: cfg.Metrics.SourceLag.WithLabelValues(cfg.Stream, "0"),
	}
	s.base = baseKey(cfg.Stream, s.subjects())
	s.incKey = IncarnationKey(cfg.Stream)
	if err := s.ensure(context.Background()); err != nil {
		return nil, err
	}
	return s, nil
}

// setupBudget is how long one set-up of the stream and the consumer
// (ensure) may take in all, however many requests it sends.
func (s *Source) setupBudget() time.Duration { return 2 * s.cfg.ConnectTimeout }

// resendEvery is how long a JetStream API request of the set-up waits for
// its answer before the same request is sent again (the first one still
// waiting): min(ConnectTimeout, 2s). See answered.
func (s *Source) resendEvery() time.Duration { return min(s.cfg.ConnectTimeout, 2*time.Second) }

// answered runs call, a JetStream API request that may be sent more than
// once (a lookup, or a create or update with the same configuration), and
// while it has no result, runs it again every s.resendEvery(), the earlier
// ones still waiting, until one returns or ctx ends. The first result
// counts, an error included; the others are cancelled.
//
// A request sent while the cluster has no quorum (no meta or stream
// leader) is answered by no server, not even once the quorum is back: with
// one request for the whole set-up budget, a start or a re-set-up begun in
// the outage waited that budget out (2 x ConnectTimeout, 10 s by default)
// and its caller's backoff after it, up to 12 s after the quorum was back
// (TestSetupDuringQuorumLoss). A request sent again notices the return
// within resendEvery. The earlier ones keep waiting rather than being
// timed out because a healthy cluster that answers slowly (later than
// resendEvery) must still be answered within the budget, as before.
//
// An answer counts at once, a 503 included: a server whose JetStream has
// run 10 s answers 503 "JetStream system temporarily unavailable" in a
// quorum loss rather than nothing (hunt H192). That ends the attempt, so
// that readiness says why the source is not set up; the service tries
// again within 2 s of such an answer (Leaderless), not after its backoff.
func answered[T any](ctx context.Context, s *Source, call func(context.Context) (T, error)) (T, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // the requests still waiting
	type result struct {
		v   T
		err error
	}
	out := make(chan result)
	send := func() {
		go func() {
			v, err := call(ctx)
			select {
			case out <- result{v, err}:
			case <-ctx.Done():
			}
		}()
	}
	send()
	t := time.NewTicker(s.resendEvery())
	defer t.Stop()
	for {
		select {
		case r := <-out:
			return r.v, r.err
		case <-ctx.Done():
			// What an unanswered request returns (the requests may see
			// it first and not hand their result over).
			var zero T
			return zero, ctx.Err()
		case <-t.C:
			s.resent.Add(1)
			send()
		}
	}
}

// jsErrClusterNotAvail is JetStream's error code (503) for a request that
// needs a leader the cluster has not: "JetStream system temporarily
// unavailable".
const jsErrClusterNotAvail = 10008

// Leaderless reports whether err is JetStream's answer that the cluster
// has no leader for the request (jsErrClusterNotAvail), which the
// quorum's return heals without the operator: the service tries a set-up
// that ended so again within 2 s, where its backoff grows to
// min(retry.max, 30 s), so the source is set up within about 2 s of the
// quorum's return (hunt H192: up to 30 s after it). Not every 503 heals
// so: a set-up answered "insufficient resources" (10023) may be at the
// cluster's max_ha_assets (the consumer's create, the stream's scale-up),
// a limit the operator must raise, and a stream's create answered a store
// failure (10077) is its disk; those keep the backoff (review R194,
// TestSetupHAAssetsLimit).
//
// ErrNoStreamLeader is one too: the stream's info answered by a replica
// while the stream has no leader.
func Leaderless(err error) bool {
	var api *jetstream.APIError
	return errors.As(err, &api) && api.ErrorCode == jsErrClusterNotAvail || errors.Is(err, ErrNoStreamLeader)
}

// ErrNoStreamLeader is the error of a look-up of the delay stream
// answered by a replica while the stream has no leader. In a quorum loss
// such a replica answers from its own state once its JetStream has run
// 10 s (nats-server 2.15, jsStreamInfoRequest), and that state may be
// behind what the source already handled (a replica cut off from the
// others while they took messages): its last sequence, below the floor,
// made the source take the stream for one restored from a backup if the
// quorum came back before the consumer's info (checkRestored), which
// lowered the floor to the consumer's ack floor and cleared the held
// spans, so that handled messages whose acks were lost were taken in
// again (TestStaleReplicaNotTakenForRestore). Its creation time and
// configuration may be as stale. Such an answer is not taken: the look-up
// fails, Leaderless, and is tried again within leaderlessRetry. Nor is
// one of a replica that names the leader (see streamLeaderErr): a server
// that lost its store answers so while it catches up.
//
// Its text says "temporarily unavailable", as the server's 503 10008
// does, which operators look for in the readiness reason (and
// TestStartWhileNATSClusterLostQuorum, bridge/service).
var ErrNoStreamLeader = errors.New("the delay stream has no leader: temporarily unavailable")

// streamLeaderErr wraps ErrNoStreamLeader when info, the answer of a
// stream look-up, is not the stream leader's: it names no leader, or it
// lists the leader it names among its replicas. The server answering
// leaves itself out of the replicas it lists unless it knows of no
// leader (nats-server 2.15, jetStream.clusterInfo), so a leader listed
// there is another server: a replica answered, from its own state. A
// replica does so, naming the leader, while it is the group's preferred
// peer and its raft node is less than 10 s old (jsStreamInfoRequest),
// such as a server that lost its store and is catching up: its last
// sequence was 0 with the leader at 2000
// (TestWipedReplicaNotTakenForRestore). A server outside a cluster names
// itself and lists no replicas.
func streamLeaderErr(info *jetstream.StreamInfo) error {
	if info == nil || info.Cluster == nil {
		return nil
	}
	leader := info.Cluster.Leader
	if leader == "" {
		return fmt.Errorf("%w (answered by a replica from its own state, which may be behind: last sequence %d)", ErrNoStreamLeader, info.State.LastSeq)
	}
	if slices.ContainsFunc(info.Cluster.Replicas, func(p *jetstream.PeerInfo) bool { return p != nil && p.Name == leader }) {
		return fmt.Errorf("%w (answered by a replica, not by the leader %s, from its own state, which may be behind: last sequence %d)", ErrNoStreamLeader, leader, info.State.LastSeq)
	}
	return nil
}

// leaderlessRetry is the longest the source waits before it tries again a
// set-up answered Leaderless.
const leaderlessRetry = 2 * time.Second

// retryPause is the running source's wait before it tries again after
// err, at each retry of Run: its backoff, at most leaderlessRetry for an
// answer that the cluster has no leader (Leaderless). Such answers come
// at once all through a quorum loss: uncapped, the backoff's 10 s, the
// source tried again up to 12 s after the quorum's return; capped, within
// about 2 s (TestRunningSourceQuorumLoss). Which request is answered so
// depends on the servers left: the stream's lookup by a replica without a
// leader when one is a replica (ErrNoStreamLeader), 503 when none is
// (reconcile); the consumer's info when the consumer has no leader and
// the stream has (consume).
//
// Nor do such answers grow the backoff past leaderlessRetry
// (backoff.nextUpTo): grown to its 10 s in the outage, it made another
// failure right after the quorum's return (a request sent before a
// leader was elected) wait up to 12 s.
func retryPause(bo *backoff, err error) time.Duration {
	if Leaderless(err) {
		return bo.nextUpTo(leaderlessRetry)
	}
	return bo.next()
}

// TemporarilyUnavailable reports whether err is a JetStream API answer
// that JetStream cannot serve the request for now (503), other than
// JetStream not enabled for the account or the server (a configuration),
// or ErrNoStreamLeader.
func TemporarilyUnavailable(err error) bool {
	var api *jetstream.APIError
	return errors.As(err, &api) && api.Code == http.StatusServiceUnavailable &&
		api.ErrorCode != jetstream.JSErrCodeJetStreamNotEnabledForAccount &&
		api.ErrorCode != jetstream.JSErrCodeJetStreamNotEnabled ||
		errors.Is(err, ErrNoStreamLeader)
}

// CheckpointKey is the shard.Checkpoint key of the floor of a delay stream
// read with the given source subject filters: "nats|STREAM|f1,f2|CREATED"
// (filters without those another covers, sorted; CREATED the stream's
// creation time, StreamInfo.Created, in Unix nanoseconds).
//
// The checkpoint says which stream sequences the store holds, so it is
// keyed by what was read, not by the consumer's name: a durable consumer
// that is renamed or recreated from the start of the stream skips what the
// store already holds instead of ingesting the whole stream again.
// Changing the filters changes the key, because a floor reached under
// other filters says nothing about messages on newly added subjects; the
// new key starts empty and at worst re-ingests messages still pending on
// the consumer. The stream's creation time is in the key because a stream
// deleted and created again (by an operator, or lost with the server's
// storage, or set up anew in another cluster) numbers its messages from 1
// again: a floor from before says nothing about it, and skipping up to it
// would lose the new stream's first messages.
func CheckpointKey(stream string, created int64, subjects []string) string {
	return baseKey(stream, subjects) + "|" + strconv.FormatInt(created, 10)
}

// baseKey is the checkpoint key without the stream's identity,
// "nats|STREAM|f1,f2", as versions before 2026-11 stored the floor (see
// Source.storedFloor).
func baseKey(stream string, subjects []string) string {
	fs := slices.Sorted(slices.Values(coveringFilters(subjects)))
	return "nats|" + stream + "|" + strings.Join(fs, ",")
}

// IncarnationKey is the shard.Checkpoint key under which the source keeps
// the incarnation of the stream (see codec.Message.Incarnation): Offset is
// the incarnation, Fingerprint the creation time (Unix ns) of the stream it
// belongs to. Every batch stores it with the floor.
func IncarnationKey(stream string) string { return bridge.NATSIncarnationKey(stream) }

// settleIncarnation sets s.inc to the incarnation of the stream created
// at id and stores it at once, before any message of it is read, so that
// a stream deleted and created again later (while the bridge runs or is
// down, with or without messages in between) is always the next one.
// Messages of different incarnations are ordered by their stored time,
// not by their sequences, which a stream created again starts at 1.
// other says that the store's floor belongs to another stream than id
// (see storedFloor and floorState.adoptLegacy). known reports whether
// the store had read a stream of this name before (an incarnation was
// stored; true for a handler that cannot load checkpoints, which cannot
// tell).
func (s *Source) settleIncarnation(ctx context.Context, h bridge.Handler, id int64, other bool) (known bool, err error) {
	l, ok := h.(bridge.CheckpointLoader)
	if !ok {
		// Nothing to compare against: a single incarnation.
		s.inc, s.incOf, s.incDue = 0, id, 0
		return true, nil
	}
	cp, stored, err := l.LoadCheckpoint(s.incKey)
	if err != nil {
		return false, fmt.Errorf("nats source: read the stream incarnation: %w", err)
	}
	inc, write := nextIncarnation(cp, stored, id, s.inc, s.incOf, other)
	if !stored && s.incOf == 0 {
		// The first stream of this name the store reads: if it has read
		// a Kafka topic of this name, their tasks share the ids' scope
		// (bridge.CrossIncarnation).
		cross, ok, err := bridge.TopicCrossIncarnation(h, s.cfg.Stream)
		if err != nil {
			return false, fmt.Errorf("nats source: read the incarnation of a Kafka topic named like the stream: %w", err)
		}
		if ok {
			inc, write = cross, true
			s.log.Warn("nats source: the store has read a Kafka delay topic named like this stream: the tasks it left pending share the scope of their ids with this stream's, "+
				"so a message here replaces or cancels the topic's task of the same id if its broker time is later",
				zap.String("stream", s.cfg.Stream), zap.Uint32("incarnation", inc))
		}
	}
	if write {
		b := &bridge.Batch{Checkpoints: []shard.Checkpoint{{Key: s.incKey, Offset: int64(inc), Fingerprint: uint64(id)}}}
		if err := h.Handle(ctx, b); err != nil {
			return stored, fmt.Errorf("nats source: store the stream incarnation: %w", err)
		}
	}
	s.inc, s.incOf, s.incDue = inc, id, 0
	return stored, nil
}

// nextIncarnation decides the incarnation of the stream created at id
// from the stored one (cp, if stored) and the one read before (prev, of
// the stream created at prevOf, 0 if none), and whether to store it.
//
//   - stored for this stream: that one;
//   - stored for another stream: one more;
//   - none stored (a store written by a version that stored the
//     incarnation only with a batch), a stream read before: its own if
//     it is this one, else one more;
//   - none stored, the store's floor of another stream (other): 1;
//   - none stored otherwise: 0, the first stream or the one a version
//     before incarnations read, whose tasks are incarnation 0 too.
func nextIncarnation(cp shard.Checkpoint, stored bool, id int64, prev uint32, prevOf int64, other bool) (inc uint32, write bool) {
	switch {
	case stored && cp.Fingerprint == uint64(id):
		return uint32(cp.Offset), false
	case stored:
		return uint32(cp.Offset) + 1, true
	case prevOf == id:
		return prev, true
	case prevOf != 0:
		return prev + 1, true
	case other:
		return 1, true
	default:
		return 0, true
	}
}

// createdKey is where a development version stored the stream identity
// of the floor under the base key, as a checkpoint of its own.
func createdKey(base string) string { return base + "|created" }

// subjects are the source filters without those another one covers.
func (s *Source) subjects() []string {
	out := make([]string, len(s.cfg.Sources))
	for i, src := range s.cfg.Sources {
		out[i] = src.Subject
	}
	return coveringFilters(out)
}

// MinDuplicateWindow is the duplicate window of a delay stream the Source
// creates: the smallest nats-server accepts (0 would mean its default,
// 2 min). JetStream drops a message whose Nats-Msg-Id it stored within the
// window, before any consumer sees it, and Nats-Msg-Id is the default task
// id (CONTRACT §1), so a replace or cancel that repeats its schedule's
// Nats-Msg-Id within the window would be lost. The bridge needs no
// publisher dedup of its own: a publish retried after the window is the
// same id again, which replaces the task with itself.
const MinDuplicateWindow = 100 * time.Millisecond

// warnDuplicateWindow says, once per start, that the delay stream drops
// replaces and cancels by Nats-Msg-Id within its duplicate window, when
// that window is longer than MinDuplicateWindow (a stream made by an
// operator, with the server's 2 min default).
func warnDuplicateWindow(log *zap.Logger, window time.Duration) {
	if window <= MinDuplicateWindow {
		return
	}
	log.Warn("nats source: the delay stream drops a message that repeats a Nats-Msg-Id it stored within its duplicate window, "+
		"so a replace or cancel relying on the default task id (Nats-Msg-Id) within that window never reaches the bridge; "+
		"replace and cancel with delay-id and a new Nats-Msg-Id, or set the stream's duplicate_window to 100ms",
		zap.Duration("duplicate_window", window))
}

// warnSourcedStream says, once per start, that a delay stream sourcing
// other streams (a hub) restamps what it sources: delay-after counts from
// the JetStream stored time (CONTRACT §1), and JetStream stores a sourced
// message at the time it sources it, not at its publish time, so a
// sourcing lag (an edge cut off from the hub) delays every task of the
// messages it held by as much. The origin's time is not in the message
// (Nats-Stream-Source has the origin's stream and sequence only). A mirror
// keeps the origin's time and gets no warning.
func warnSourcedStream(log *zap.Logger, sources []*jetstream.StreamSource) {
	if len(sources) == 0 {
		return
	}
	names := make([]string, 0, len(sources))
	for _, src := range sources {
		if src != nil {
			names = append(names, src.Name)
		}
	}
	log.Warn("nats source: the delay stream sources other streams, and JetStream stores a sourced message at the time it sources it, "+
		"not at its publish time: delay-after counts from then, so a sourcing lag (a stream cut off from this one) delays those tasks by as much; "+
		"publish delay-at to such streams, or read a mirror, which keeps the origin's time",
		zap.Strings("sourced_streams", names))
}

// jsStreamSubjectOverlap is the server's error code for a stream whose
// subjects another stream already captures.
const jsStreamSubjectOverlap = 10065

// subjectOwners names (quoted) the streams that capture subjects, when
// err is the server refusing a new stream for that overlap; nil for any
// other error or when the lookup fails (the server's text then stands).
func (s *Source) subjectOwners(ctx context.Context, err error, subjects []string) []string {
	var api *jetstream.APIError
	if !errors.As(err, &api) || api.ErrorCode != jsStreamSubjectOverlap {
		return nil
	}
	var owners []string
	for _, sub := range subjects {
		name, lerr := s.js.StreamNameBySubject(ctx, sub)
		if lerr != nil {
			continue
		}
		if q := strconv.Quote(name); !slices.Contains(owners, q) {
			owners = append(owners, q)
		}
	}
	return owners
}

// ensure looks up (or creates) the stream and the consumer and keeps the
// consumer handle for Run. It takes setupBudget at most; its requests are
// sent again while unanswered (see answered).
func (s *Source) ensure(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.setupBudget())
	defer cancel()
	subjects := s.subjects()
	stream, err := s.lookupStream(ctx)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) && s.cfg.Create:
		// A work queue: once a message is acked the bridge's store holds
		// it, the stream has no reason to keep it.
		sc := jetstream.StreamConfig{
			Name:        s.cfg.Stream,
			Description: "delaybridge delay subjects",
			Subjects:    subjects,
			Retention:   jetstream.WorkQueuePolicy,
			Storage:     jetstream.FileStorage,
			Duplicates:  MinDuplicateWindow,
			Replicas:    s.cfg.Replicas,
		}
		// Created again with the same configuration, a stream is not
		// changed: the request may be sent more than once.
		stream, err = answered(ctx, s, func(ctx context.Context) (jetstream.Stream, error) { return s.js.CreateStream(ctx, sc) })
		if err != nil {
			if owners := s.subjectOwners(ctx, err, subjects); len(owners) > 0 {
				return fmt.Errorf("%w: nats.stream %q cannot be created: its subjects %v are those of stream %s (was nats.stream renamed?): "+
					"set nats.stream back to keep reading it, or remove that stream (or its subjects) once nothing in it is left to read; "+
					"the store's pending tasks are kept either way: %w",
					ErrConfig, s.cfg.Stream, subjects, strings.Join(owners, ", "), err)
			}
			return fmt.Errorf("nats source: create stream %q with subjects %v and %d replicas: %w", s.cfg.Stream, subjects, max(s.cfg.Replicas, 1), err)
		}
		s.log.Info("nats source: created stream", zap.Strings("subjects", subjects), zap.Int("replicas", stream.CachedInfo().Config.Replicas))
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return fmt.Errorf("%w: stream %q (create it with subjects %v, or set nats.create: true): %w",
			ErrNoStream, s.cfg.Stream, subjects, err)
	case err != nil:
		return fmt.Errorf("nats source: look up stream %q: %w", s.cfg.Stream, err)
	default:
		cfg := stream.CachedInfo().Config
		var missing []string
		for _, sub := range subjects {
			if !slices.ContainsFunc(cfg.Subjects, func(f string) bool { return filterCovers(f, sub) }) {
				missing = append(missing, sub)
			}
		}
		if len(missing) > 0 && cfg.Mirror != nil && s.cfg.Create {
			return fmt.Errorf("%w: stream %q is a mirror of %q, which takes no subjects of its own; set nats.create: false and give the bridge a consumer on it",
				ErrConfig, s.cfg.Stream, cfg.Mirror.Name)
		}
		if len(missing) > 0 && !s.cfg.Create && (cfg.Mirror != nil || len(cfg.Sources) > 0) {
			// Its messages come from other streams, with their subjects
			// (or transformed ones): which of them it stores cannot be
			// read from its own subjects.
			s.log.Info("nats source: the stream mirrors or sources other streams; whether it stores the source subjects is not checked",
				zap.Strings("source_subjects", missing))
			missing = nil
		}
		if len(missing) > 0 && !s.cfg.Create {
			s.log.Warn("nats source: stream does not capture some source subjects; messages published there are not stored",
				zap.Strings("missing", missing), zap.Strings("stream_subjects", cfg.Subjects))
		}
		if s.cfg.Create && cfg.Mirror == nil && len(cfg.Sources) == 0 {
			// The bridge adds subjects to the stream and never takes
			// any away (another consumer may read them): one dropped from
			// the sources is still stored, and acknowledged to its
			// publishers, and the bridge does not read it.
			var unread []string
			for _, f := range cfg.Subjects {
				if !slices.ContainsFunc(subjects, func(src string) bool { return filterCovers(src, f) }) {
					unread = append(unread, f)
				}
			}
			if len(unread) > 0 {
				s.log.Warn("nats source: the stream captures subjects that no source reads (taken out of nats.sources?): messages published there are stored "+
					"and acknowledged to their publishers, and the bridge does not schedule them; remove them from the stream (nats stream edit) "+
					"unless another consumer reads them, or add them to nats.sources again",
					zap.Strings("unread", unread), zap.Strings("sources", subjects))
			}
		}
		rescale := s.cfg.Create && s.cfg.Replicas > 0 && max(cfg.Replicas, 1) != s.cfg.Replicas
		if (len(missing) > 0 && s.cfg.Create) || rescale {
			was := cfg.Replicas
			cfg.Subjects = append(slices.Clone(cfg.Subjects), missing...)
			if rescale {
				cfg.Replicas = s.cfg.Replicas
			}
			if stream, err = answered(ctx, s, func(ctx context.Context) (jetstream.Stream, error) { return s.js.UpdateStream(ctx, cfg) }); err != nil {
				var what []string
				if len(missing) > 0 {
					what = append(what, fmt.Sprintf("add subjects %v", missing))
				}
				if rescale {
					what = append(what, fmt.Sprintf("replicas %d", cfg.Replicas))
				}
				return fmt.Errorf("nats source: update stream %q (%s): %w", s.cfg.Stream, strings.Join(what, ", "), err)
			}
			if len(missing) > 0 {
				s.log.Info("nats source: added subjects to stream", zap.Strings("subjects", missing))
			}
			if rescale {
				s.log.Info("nats source: changed the stream's replicas", zap.Int("from", max(was, 1)), zap.Int("to", cfg.Replicas))
			}
		}
	}

	info := stream.CachedInfo()
	if info != nil {
		s.created.Store(info.Created.UnixNano())
		s.lastSeq.Store(info.State.LastSeq)
	}

	var cons jetstream.Consumer
	if s.cfg.Create {
		cc := jetstream.ConsumerConfig{
			Durable:       s.cfg.Consumer,
			Description:   consumerDescription,
			DeliverPolicy: jetstream.DeliverAllPolicy,
			AckPolicy:     jetstream.AckExplicitPolicy,
		}
		// An existing consumer keeps what cannot be updated (where it
		// started); the rest is set to what the bridge needs.
		if old, err := answered(ctx, s, s.lookupConsumer); err == nil {
			cc = old.CachedInfo().Config
			if cc.AckPolicy != jetstream.AckExplicitPolicy || cc.DeliverSubject != "" {
				return fmt.Errorf("%w: consumer %q on stream %q exists with ack policy %s (push: %v); need an explicit-ack pull consumer",
					ErrConfig, s.cfg.Consumer, s.cfg.Stream, cc.AckPolicy, cc.DeliverSubject != "")
			}
			if err := s.checkPriority(cc); err != nil {
				return err
			}
			if gained := gainedFilters(cc, subjects); len(gained) > 0 {
				if s.widenConsumer(ctx, stream, old.CachedInfo(), gained) {
					cc = jetstream.ConsumerConfig{
						Durable:       s.cfg.Consumer,
						Description:   consumerDescription,
						DeliverPolicy: jetstream.DeliverAllPolicy,
						AckPolicy:     jetstream.AckExplicitPolicy,
					}
				}
			}
		}
		cc.AckWait = s.cfg.AckWait
		cc.MaxDeliver = -1 // never give up on a message: nothing is dropped
		cc.MaxAckPending = s.cfg.MaxAckPending
		if info := stream.CachedInfo(); info != nil {
			// A stream may cap its consumers' max ack pending, and the
			// server refuses a consumer asking for more.
			if lim := info.Config.ConsumerLimits.MaxAckPending; lim > 0 && cc.MaxAckPending > lim {
				cc.MaxAckPending = lim
			}
		}
		cc.FilterSubject, cc.FilterSubjects = "", subjects
		cons, err = s.createConsumer(ctx, cc)
		if apiErr := (*jetstream.APIError)(nil); errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrConsumerMaxAckPendingExcess {
			// The account's or the server's limit, which the bridge
			// cannot read: let the server choose (its default, within it).
			s.log.Warn("nats source: the server caps max ack pending below the bridge's; the consumer takes the server's default",
				zap.Int("max_ack_pending", cc.MaxAckPending), zap.Error(err))
			cc.MaxAckPending = 0
			cons, err = s.createConsumer(ctx, cc)
		}
		if apiErr := (*jetstream.APIError)(nil); errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrConsumerWQNotUnique {
			return s.workQueueTaken(ctx, stream, err)
		}
		if err != nil {
			return fmt.Errorf("nats source: create consumer %q on stream %q: %w", s.cfg.Consumer, s.cfg.Stream, err)
		}
	} else {
		cons, err = answered(ctx, s, s.lookupConsumer)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			return fmt.Errorf("%w: consumer %q on stream %q (create it, or set nats.create: true): %w",
				ErrNoConsumer, s.cfg.Consumer, s.cfg.Stream, err)
		}
		if err != nil {
			return fmt.Errorf("nats source: look up consumer %q on stream %q: %w", s.cfg.Consumer, s.cfg.Stream, err)
		}
		cc := cons.CachedInfo().Config
		if cc.AckPolicy != jetstream.AckExplicitPolicy {
			return fmt.Errorf("%w: consumer %q on stream %q has ack policy %s, need explicit",
				ErrConfig, s.cfg.Consumer, s.cfg.Stream, cc.AckPolicy)
		}
		if cc.DeliverSubject != "" {
			return fmt.Errorf("%w: consumer %q on stream %q is a push consumer, need pull",
				ErrConfig, s.cfg.Consumer, s.cfg.Stream)
		}
		if err := s.checkPriority(cc); err != nil {
			return err
		}
		filters := consumerFilters(cc)
		if len(filters) == 0 && stream != nil {
			sc := stream.CachedInfo().Config
			filters = sc.Subjects
			if sc.Mirror != nil || len(sc.Sources) > 0 {
				// Unfiltered, it reads what the mirror or the sources
				// bring too, under subjects the stream's own do not
				// show: everything, as far as the bridge can tell.
				filters = []string{">"}
			}
		}
		for _, f := range filters {
			if !slices.ContainsFunc(subjects, func(src string) bool { return filterCovers(src, f) }) {
				return fmt.Errorf("%w: consumer %q on stream %q reads %q, which no configured source subject covers (sources %v)",
					ErrConfig, s.cfg.Consumer, s.cfg.Stream, f, subjects)
			}
		}
		// The other way round is allowed (a consumer may read part of a
		// source subject), but what it leaves out the stream stores and
		// acknowledges to the publisher, and nothing ever schedules.
		var unread []string
		for _, sub := range subjects {
			if !slices.ContainsFunc(filters, func(f string) bool { return filterCovers(f, sub) }) {
				unread = append(unread, sub)
			}
		}
		if len(unread) > 0 {
			s.log.Warn("nats source: the consumer does not read all of some source subjects; delay messages the stream stores there outside its filters are never scheduled",
				zap.String("consumer", s.cfg.Consumer), zap.Strings("source_subjects", unread), zap.Strings("consumer_filters", filters))
		}
		if cc.MaxDeliver > 0 {
			s.log.Warn("nats source: consumer has max_deliver set; a message delivered that often is dropped by the server (every redelivery counts: after a failure, or the nak of what was received and not handled at a stop)",
				zap.Int("max_deliver", cc.MaxDeliver))
		}
	}
	s.setAckWait(cons.CachedInfo().Config)
	s.consumer.Store(&consumerRef{cons})
	s.consErr.Store(nil)
	// Logged once the source is set up, not at every try of a start
	// retried while the consumer does not answer.
	if info != nil {
		warnDuplicateWindow(s.log, info.Config.Duplicates)
		warnSourcedStream(s.log, info.Config.Sources)
		if cluster := s.nc.ConnectedClusterName(); cluster != "" && max(info.Config.Replicas, 1) == 1 && s.cfg.Replicas == 0 {
			s.log.Warn("nats source: the delay stream has one replica on a NATS cluster: while its server is down publishers cannot reach the delay subjects, "+
				"and messages not yet taken by the bridge are lost with its disk; give it 3 replicas (nats.replicas with nats.create, or nats stream edit)",
				zap.String("cluster", cluster))
		}
	}
	return nil
}

// consumerDescription is the description of the consumers the source
// creates (nats.create), by which it tells them from an operator's.
const consumerDescription = "delaybridge"

// otherBridgesWait bounds warnOtherBridgeConsumers.
const otherBridgesWait = 5 * time.Second

// warnOtherBridgeConsumers logs the stream's other consumers made by a
// delaybridge (consumerDescription) that read some of the source
// subjects: after nats.consumer was renamed, the old one, which no bridge
// reads any more. A work-queue stream refuses the new one
// (workQueueTaken); on an interest stream the old one keeps every message
// stored, unacknowledged, until the stream's limits (and then, with
// discard new, publishers are refused); on any stream, one that is pulled
// from is read by another bridge, which takes in every message as this
// one does: each task is delivered by both. It runs beside consuming
// (Run), once, within otherBridgesWait, and lists the consumers only when
// the stream has others than the bridge's: listing needs
// $JS.API.CONSUMER.LIST, which a user without it is denied (an async
// error line, no answer), and nothing is said then.
func (s *Source) warnOtherBridgeConsumers(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, otherBridgesWait)
	defer cancel()
	stream, err := s.js.Stream(ctx, s.cfg.Stream)
	if err != nil {
		s.log.Debug("nats source: stream info for other bridges' consumers failed", zap.Error(err))
		return
	}
	info := stream.CachedInfo()
	if info == nil || info.State.Consumers <= 1 || info.Config.Retention == jetstream.WorkQueuePolicy {
		return
	}
	subjects := s.subjects()
	var idle, pulled []string
	lister := stream.ListConsumers(ctx)
	for ci := range lister.Info() {
		if ci == nil || ci.Name == s.cfg.Consumer || ci.Config.Description != consumerDescription || ci.Config.DeliverSubject != "" {
			continue
		}
		filters := consumerFilters(ci.Config)
		if len(filters) == 0 {
			filters = []string{">"}
		}
		if !slices.ContainsFunc(filters, func(f string) bool {
			return slices.ContainsFunc(subjects, func(sub string) bool { return filtersOverlap(f, sub) })
		}) {
			continue
		}
		if ci.NumWaiting > 0 {
			pulled = append(pulled, ci.Name)
		} else {
			idle = append(idle, ci.Name)
		}
	}
	if err := lister.Err(); err != nil {
		s.log.Debug("nats source: listing the stream's consumers failed; other bridges' consumers not looked for", zap.Error(err))
	}
	if len(pulled) > 0 {
		s.log.Warn("nats source: another client pulls from consumers made by delaybridge that read source subjects of this bridge (or a bridge stopped moments ago did): if another bridge, "+
			"both take in every message, and each task is delivered by both (a cancel or replace reaches only the tasks of the bridge that reads it); run one bridge per delay stream",
			zap.Strings("consumers", pulled))
	}
	if len(idle) == 0 {
		return
	}
	if info.Config.Retention == jetstream.InterestPolicy {
		s.log.Warn("nats source: the delay stream keeps each message until every consumer acknowledged it (interest retention), and consumers made by delaybridge "+
			"that no bridge reads also read source subjects (nats.consumer renamed?): the stream keeps every message for them, up to its limits; "+
			"delete them (nats consumer rm STREAM NAME)",
			zap.Strings("consumers", idle))
		return
	}
	s.log.Info("nats source: the stream has consumers made by delaybridge that no bridge reads (nats.consumer renamed?); they keep nothing from being removed on this stream, delete them (nats consumer rm STREAM NAME)",
		zap.Strings("consumers", idle))
}

// createConsumer creates or updates the durable consumer with cc (a copy:
// a request sent again after ensure changed its own may not see that).
func (s *Source) createConsumer(ctx context.Context, cc jetstream.ConsumerConfig) (jetstream.Consumer, error) {
	return answered(ctx, s, func(ctx context.Context) (jetstream.Consumer, error) {
		return s.js.CreateOrUpdateConsumer(ctx, s.cfg.Stream, cc)
	})
}

// lookupConsumer asks the server for the durable consumer.
func (s *Source) lookupConsumer(ctx context.Context) (jetstream.Consumer, error) {
	return s.js.Consumer(ctx, s.cfg.Stream, s.cfg.Consumer)
}

// jsErrConsumerMaxAckPendingExcess is JetStream's error code for a
// consumer whose max ack pending exceeds the stream's, the account's or
// the server's limit.
const jsErrConsumerMaxAckPendingExcess = 10121

// jsErrConsumerWQNotUnique is JetStream's error code for a consumer whose
// filters overlap another consumer's on a work-queue stream ("filtered
// consumer not unique on workqueue stream"): one message, one consumer.
const jsErrConsumerWQNotUnique = 10100

// checkPriority refuses a consumer with priority groups: the server
// refuses every pull that names no group (400 Priority Group missing), and
// the source, which names none, would take nothing in while reporting
// ready (review R156).
func (s *Source) checkPriority(cc jetstream.ConsumerConfig) error {
	if cc.PriorityPolicy == jetstream.PriorityPolicyNone && len(cc.PriorityGroups) == 0 {
		return nil
	}
	policy, _ := cc.PriorityPolicy.MarshalJSON()
	return fmt.Errorf("%w: consumer %q on stream %q has priority groups %v (policy %s); need one without",
		ErrConfig, s.cfg.Consumer, s.cfg.Stream, cc.PriorityGroups, policy)
}

// consumerFilters returns the subject filters of the consumer cc, set in
// either field (none: it reads the whole stream).
func consumerFilters(cc jetstream.ConsumerConfig) []string {
	if cc.FilterSubject != "" {
		return []string{cc.FilterSubject}
	}
	return cc.FilterSubjects
}

// gainedFilters returns the source subjects that the existing consumer
// cc does not read (none when it reads the whole stream).
func gainedFilters(cc jetstream.ConsumerConfig, subjects []string) []string {
	filters := consumerFilters(cc)
	if len(filters) == 0 {
		return nil
	}
	var gained []string
	for _, sub := range subjects {
		if !slices.ContainsFunc(filters, func(f string) bool { return filterCovers(f, sub) }) {
			gained = append(gained, sub)
		}
	}
	return gained
}

// widenConsumer handles an existing consumer whose filters the source
// subjects now widen by gained. JetStream does not rewind a consumer
// whose filters change: a message the stream already held on a gained
// subject below the consumer's position (published while the subject was
// no source of the bridge, or before the bridge read it) would never be
// delivered. On a work-queue stream, which holds only messages no
// consumer acknowledged, the consumer is deleted and created again from
// the start of the stream (it returns true): it then delivers those
// messages, and again those its predecessor had not had acknowledged,
// which a changed set of source subjects may take in again anyway (their
// floor is kept per set of subjects). On another stream a new consumer
// would deliver every message it keeps, so the consumer is updated and
// the skipped range is logged.
func (s *Source) widenConsumer(ctx context.Context, stream jetstream.Stream, ci *jetstream.ConsumerInfo, gained []string) (recreated bool) {
	passed := ci.Delivered.Stream
	if passed == 0 || stream == nil || stream.CachedInfo() == nil {
		return false
	}
	if stream.CachedInfo().Config.Retention != jetstream.WorkQueuePolicy {
		s.log.Error("nats source: the source subjects now include subjects the consumer did not read, and JetStream does not rewind a consumer "+
			"whose filters change: messages the stream already held on them up to the consumer's position are not delivered; "+
			"to read them, stop the bridge, copy them to a delay subject again, or delete the consumer (nats consumer rm) to read the stream again from its start",
			zap.Strings("gained", gained), zap.Uint64("up_to_stream_seq", passed))
		return false
	}
	if err := s.js.DeleteConsumer(ctx, s.cfg.Stream, s.cfg.Consumer); err != nil {
		// A repair, not a condition of the start (the user may lack
		// $JS.API.CONSUMER.DELETE): updated, the consumer reads on.
		s.log.Error("nats source: the source subjects now include subjects the consumer did not read, and it could not be created again from the start of the work queue: "+
			"messages the stream already held on them up to the consumer's position are not delivered (JetStream does not rewind a consumer whose filters change); "+
			"to read them, stop the bridge and delete the consumer (nats consumer rm)",
			zap.Strings("gained", gained), zap.Uint64("up_to_stream_seq", passed), zap.Error(err))
		return false
	}
	s.log.Warn("nats source: the source subjects now include subjects the consumer did not read; created it again from the start of the work queue "+
		"so that the messages it holds on them are delivered (JetStream does not rewind a consumer whose filters change)",
		zap.Strings("gained", gained), zap.Uint64("was_at_stream_seq", passed))
	return true
}

// workQueueTaken is the error of a consumer that a work-queue stream
// refused because another consumer reads its subjects: after a rename of
// nats.consumer (or nats.stream kept with another bridge's consumer), the
// old one. It names the others, and the remedy.
func (s *Source) workQueueTaken(ctx context.Context, stream jetstream.Stream, err error) error {
	var others []string
	names := stream.ConsumerNames(ctx)
	for n := range names.Name() {
		if n != s.cfg.Consumer {
			others = append(others, n)
		}
	}
	// Listing needs $JS.API.CONSUMER.NAMES; without it, no names.
	who, old := "another consumer", "OLD"
	if len(others) > 0 {
		who = fmt.Sprintf("its consumers %v", others)
	}
	if len(others) == 1 {
		old = others[0]
	}
	return fmt.Errorf("%w: nats.consumer %q: stream %q is a work queue, where only one consumer may read a subject, and %s already read some of the source subjects %v "+
		"(if nats.consumer was renamed, delete the old consumer while the bridge is stopped, nats consumer rm %s %s: its unacknowledged messages then go to the new one, "+
		"and the store keeps what it already holds from being taken in again): %w",
		ErrConfig, s.cfg.Consumer, s.cfg.Stream, who, s.subjects(), s.cfg.Stream, old, err)
}

// setAckWait takes the redelivery wait from the consumer's configuration
// as the server reports it: a consumer made by an operator need not have
// Config.AckWait, and with BackOff the server waits BackOff[n] instead.
func (s *Source) setAckWait(cc jetstream.ConsumerConfig) {
	d := redeliveryWait(cc)
	if d <= 0 {
		d = s.cfg.AckWait
	}
	if old := time.Duration(s.ackWait.Swap(int64(d))); old != d && old != 0 {
		s.log.Info("nats source: consumer ack wait changed", zap.Duration("ack_wait", d), zap.Duration("was", old))
	}
}

// redeliveryWait is the shortest time the server waits for an ack before
// it redelivers a message of a consumer with config cc: AckWait, or with
// BackOff the step of the message's delivery count. 0 if unknown.
func redeliveryWait(cc jetstream.ConsumerConfig) time.Duration {
	d := cc.AckWait
	for _, b := range cc.BackOff {
		if b > 0 && (d <= 0 || b < d) {
			d = b
		}
	}
	return d
}

// keepAlivePeriod is how often a batch in hand is marked in progress: a
// third of the redelivery wait, so that two marks may be lost.
func (s *Source) keepAlivePeriod() time.Duration {
	d := time.Duration(s.ackWait.Load())
	if d <= 0 {
		d = s.cfg.AckWait
	}
	return max(d/3, 10*time.Millisecond)
}

// Health is nil while connected and the consumer exists and answers.
func (s *Source) Health() error {
	if err := connErr(s.nc); err != nil {
		return err
	}
	if p := s.consErr.Load(); p != nil {
		return *p
	}
	return nil
}

func (s *Source) setConsErr(err error) { s.consErr.Store(&err) }

// Close stops a running Run and waits until it returned. It does not close
// the connection, which the caller owns.
func (s *Source) Close() error {
	s.mu.Lock()
	s.closed = true
	cancel, running := s.cancel, s.running
	s.mu.Unlock()
	if cancel != nil {
		cancel()
		<-running
	}
	return nil
}

// floorState is what Run knows about which stream sequences are held.
//
// The checkpoint handed to the handler is a floor: every message of the
// consumer with a stream sequence at or below it is durably handled or
// acked. A plain "highest sequence handled" would not do: JetStream
// redelivers unacked messages after AckWait, behind newer first deliveries,
// so a message abandoned by a crash can arrive after higher sequences were
// handled, and skipping it would lose it.
//
// First deliveries come in stream order and every delivery, first or not,
// gets the next consumer sequence. So while the consumer sequences the
// source sees are contiguous, everything up to the highest handled sequence
// is handled. Where that is not known (messages delivered before this
// consume started and not yet acked; a gap in consumer sequences, meaning
// a delivery was lost in transit or went to another client), a barrier
// holds the floor back until the server's ack floor has passed the barrier.
// The barrier must be at least the sequence of every delivery missed. One
// missed right before a first delivery was of a lower sequence (first
// deliveries come in stream order, and a redelivered message was first
// delivered before); one missed right before a redelivery may have been
// of any sequence the consumer had delivered by then (a first delivery to
// another instance sharing the consumer), so the next consumer info's
// delivered sequence bounds it before the ack floor is compared.
//
// floorState is pure: the Source feeds it consumer info and deliveries.
type floorState struct {
	floor      int64  // proven floor; messages at or below it are skipped
	maxHandled int64  // highest stream sequence durably handled
	barrier    int64  // 0: none; else the floor waits for ack floor >= barrier
	lastDseq   uint64 // last consumer (delivery) sequence seen
	maxSeen    int64  // highest stream sequence seen
	// unbounded: a delivery was missed right before a redelivery; the
	// barrier is raised to the consumer's delivered sequence at the next
	// ack floor check (see ackFloor) before it may clear.
	unbounded bool
	lastCheck time.Time
	// legacy is a stored floor without the stream identity (written by an
	// older version), not yet trusted: see adoptLegacy.
	legacy int64

	// spans are stream sequences above the floor known held: every
	// message of the consumer in a span was durably handled (or acked as
	// held). While a barrier holds the floor back, what is handled above
	// it is recorded here and stored with the floor (heldSlots slots
	// under HeldKey), so that a message whose ack is lost (a second
	// crash, a connection lost between the store commit and the ack) is
	// skipped when it comes back instead of being taken in again: its task
	// may have been delivered and deleted meanwhile, and would be
	// delivered twice. Sorted, disjoint, at most heldSlots.
	spans []span
	// pend: what the deliveries of the batch in hand add to spans once it
	// is durable (see see and handled).
	pend []span
	// unseen: stream sequences the consumer delivered to this source
	// that it never received (in flight at a crash, or on a connection
	// lost at a reconnect), for the Source to nak: the server would
	// redeliver them only after AckWait (see takeUnseen). nakHi is the
	// highest sequence ever put there, so none is asked back twice.
	unseen []span
	nakHi  int64
	// gaps counts the gaps in consumer sequences seen, for the Source to
	// tell those of a lost connection from another client's (see
	// Source.checkGaps). ownDseq is the consumer's delivered sequence read
	// after the last reset: a delivery missed up to it went down the lost
	// connection (a redelivery there shows as a gap only at the next
	// delivery, on a quiet stream long after), not to another client.
	gaps    int
	ownDseq uint64
	// runLo is the stream sequence of the first of the first deliveries
	// seen since the last gap in consumer sequences (0: none). First
	// deliveries come in stream order, so every message of the consumer
	// between runLo and the last first delivery was delivered to this
	// consume: one span.
	runLo int64
	// stored is what the held slots hold in the store.
	stored heldSlotState
}

// heldSlotState is what the held slots hold: each one's span and the
// incarnation it was stored in.
type heldSlotState struct {
	span [heldSlots]span
	inc  [heldSlots]uint32
}

// span is a range of stream sequences, both ends included.
type span struct{ lo, hi int64 }

// heldSlots is how many spans of sequences held above the floor a source
// stores. More disjoint spans than that (handled redeliveries scattered
// between unhandled ones) lose the lowest: a message of those whose ack is
// lost is taken in again, as without the record.
const heldSlots = 16

// HeldKey is the shard.Checkpoint key of slot i of the spans held above
// the floor stored under the checkpoint key key (see floorState.spans):
// Offset the span's last sequence, Fingerprint its first; Offset 0 for an
// empty slot.
func HeldKey(key string, i int) string { return key + "|held|" + strconv.Itoa(i) }

// isHeld reports whether seq is at or below the floor or in a span.
func (f *floorState) isHeld(seq int64) bool {
	if seq <= f.floor {
		return true
	}
	for _, sp := range f.spans {
		if sp.lo <= seq && seq <= sp.hi {
			return true
		}
	}
	return false
}

// mergeSpans sorts and merges spans, drops those at or below floor and
// keeps the highest heldSlots.
func mergeSpans(spans []span, floor int64) []span {
	spans = slices.DeleteFunc(spans, func(sp span) bool { return sp.hi <= floor })
	slices.SortFunc(spans, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
	out := spans[:0]
	for _, sp := range spans {
		if n := len(out); n > 0 && sp.lo <= out[n-1].hi+1 {
			out[n-1].hi = max(out[n-1].hi, sp.hi)
			continue
		}
		out = append(out, sp)
	}
	if len(out) > heldSlots {
		out = out[len(out)-heldSlots:]
	}
	return slices.Clip(out)
}

// nextSpans is spans once the batch in hand is durable with checkpoint cp.
func (f *floorState) nextSpans(cp int64) []span {
	all := make([]span, 0, len(f.spans)+len(f.pend))
	all = append(append(all, f.spans...), f.pend...)
	return mergeSpans(all, cp)
}

// commitPend takes the batch in hand's spans without storing them: a
// batch with nothing to store (every message held already, or a server
// marker). The next batch stores them.
func (f *floorState) commitPend() {
	f.spans = f.nextSpans(f.floor)
	f.pend = f.pend[:0]
}

// heldCheckpoints are the writes that make the stored slots of key hold
// next, and the slots as they will be. Each slot is stored with the
// stream's incarnation inc (see keepIncarnation). Aside: they are records
// beside the floor, not positions a reader resumes from.
func (f *floorState) heldCheckpoints(key string, inc uint32, next []span) ([]shard.Checkpoint, heldSlotState) {
	var want heldSlotState
	copy(want.span[:], next)
	var cps []shard.Checkpoint
	for i := range want.span {
		want.inc[i] = inc
		if want.span[i] != f.stored.span[i] || (want.span[i] != span{} && f.stored.inc[i] != inc) {
			cps = append(cps, shard.Checkpoint{Key: HeldKey(key, i), Offset: want.span[i].hi, Fingerprint: uint64(want.span[i].lo),
				Incarnation: inc, Aside: true})
		} else {
			want.inc[i] = f.stored.inc[i] // unchanged: as stored
		}
	}
	return cps, want
}

// loadHeld sets the stored slots, and the incarnations they were stored
// in, from the store; keepIncarnation then takes the spans of the
// stream's incarnation.
func (f *floorState) loadHeld(stored heldSlotState) {
	f.stored = stored
	f.spans = nil
}

// keepIncarnation takes as held the stored spans of incarnation inc. A
// slot of another one was left by a version that did not clear the slots
// when it found the stream restored from a backup (a new incarnation):
// its sequences may be new messages. Still in f.stored, it is cleared by
// the next write of its slot.
func (f *floorState) keepIncarnation(inc uint32) {
	var spans []span
	for i, sp := range f.stored.span {
		if f.stored.inc[i] == inc && sp.hi > 0 && sp.lo > 0 && sp.lo <= sp.hi {
			spans = append(spans, sp)
		}
	}
	f.spans = mergeSpans(spans, f.floor)
}

// maxHeld is the highest sequence known held.
func (f *floorState) maxHeld() int64 {
	m := max(f.floor, f.maxHandled)
	if n := len(f.spans); n > 0 {
		m = max(m, f.spans[n-1].hi)
	}
	return m
}

// adoptLegacy decides, at the first consume's start, on a floor stored
// without the stream's identity, given the stream sequence the consumer
// has delivered up to. Such a floor may come from a stream since deleted
// and created again, and then skipping up to it would lose the new
// stream's first messages. It is kept only if the consumer has delivered
// that far on the current stream: then this stream's messages up to it
// went through this consumer (to the version that stored the floor).
// Otherwise it is dropped, and the worst case is ingesting again what the
// consumer redelivers (a duplicate, never a loss); the server's ack floor
// still applies. It reports whether the floor was kept.
// legacyOther reports whether a legacy floor is dropped when the consumer
// has delivered up to delivered: then it is likely another stream's.
func (f *floorState) legacyOther(delivered int64) bool {
	return f.legacy != 0 && delivered < f.legacy
}

func (f *floorState) adoptLegacy(delivered int64) (kept bool) {
	if f.legacy == 0 {
		return false
	}
	kept = !f.legacyOther(delivered)
	if kept {
		f.floor = max(f.floor, f.legacy)
	}
	f.legacy = 0
	return kept
}

// start is called when a consume starts, with the consumer's info.
func (f *floorState) start(ackFloor, delivered int64, deliveredDseq uint64) {
	f.floor = max(f.floor, ackFloor)
	f.pend, f.runLo = f.pend[:0], 0
	f.spans = mergeSpans(f.spans, f.floor)
	f.lastDseq = deliveredDseq
	f.ownDseq = deliveredDseq // not kept from another consumer's sequences
	f.maxSeen = max(f.maxSeen, delivered)
	if ackFloor < delivered {
		// Delivered before this consume and not all acked: those come
		// back as redeliveries, in no particular order relative to new
		// messages. None of them is on its way to a live pull (this
		// consume has none yet, the last one's were drained or nak'd),
		// so every one still pending is lost or has its ack on the way.
		f.barrier = max(f.barrier, delivered)
		f.addUnseen(ackFloor+1, delivered)
	}
}

// resumed is called when the pulls were reset by a reconnect, with the
// consumer's delivered sequences read afterwards. Deliveries beyond the
// last one seen went down the lost connection: they were first
// deliveries of sequences above the highest one seen, or redeliveries
// (not known: AckWait brings those back). The gap itself is noted by see
// at the next delivery. The messages the reset left aside, received and
// not yet seen (asideDseq, asideSeq: their highest sequences), count as
// seen (a gap among them, a pull of the lost connection that outlived it
// at the server, is see's).
func (f *floorState) resumed(delivered int64, deliveredDseq uint64, asideDseq uint64, asideSeq int64) {
	f.ownDseq = max(f.ownDseq, deliveredDseq)
	if deliveredDseq > max(f.lastDseq, asideDseq) {
		f.addUnseen(max(f.maxSeen, asideSeq)+1, delivered)
	}
}

// addUnseen adds the sequences lo..hi not added before to unseen. Those
// held already (at or below the floor, in a span: stored, their ack lost)
// are asked back too: redelivered, they are skipped as held and acked, so
// the ack floor, which CaughtUp waits for (Source.atEnd), passes them now
// rather than after AckWait.
func (f *floorState) addUnseen(lo, hi int64) {
	lo = max(lo, f.nakHi+1)
	if lo > hi {
		return
	}
	f.unseen = append(f.unseen, span{lo, hi})
	f.nakHi = hi
}

// takeUnseen returns the sequences to nak and forgets them.
func (f *floorState) takeUnseen() []span {
	u := f.unseen
	f.unseen = nil
	return u
}

// see registers a delivery (first: its first delivery) and reports whether
// the message is already held.
func (f *floorState) see(dseq uint64, seq int64, first bool) (held bool) {
	if dseq != f.lastDseq+1 {
		// A delivery this consume did not see: lost in transit or taken
		// by another client. Before a first delivery it was of a lower
		// sequence; before a redelivery of any the consumer had delivered.
		f.barrier = max(f.barrier, f.maxSeen, seq)
		if !first {
			f.unbounded = true
		} else {
			// First deliveries come in stream order: every sequence
			// between the highest seen and this one that is still
			// pending was delivered and lost (or is another client's:
			// unsupported, see Source.checkGaps).
			f.addUnseen(f.maxSeen+1, seq-1)
		}
		if dseq-1 > f.ownDseq {
			f.gaps++
		}
		f.runLo = 0 // the missed delivery may lie inside a span to come
	}
	f.lastDseq = max(f.lastDseq, dseq)
	f.maxSeen = max(f.maxSeen, seq)
	held = f.isHeld(seq)
	if first {
		// Every message of the consumer between the run's first
		// delivery and this one was delivered in between, to this
		// consume.
		if f.runLo == 0 {
			f.runLo = seq
		}
		if n := len(f.pend); n > 0 && f.pend[n-1].lo == f.runLo {
			f.pend[n-1].hi = max(f.pend[n-1].hi, seq) // one span per run, not per message
		} else {
			f.pend = append(f.pend, span{f.runLo, seq})
		}
	} else {
		f.pend = append(f.pend, span{seq, seq})
	}
	return held
}

// checkpoint is the floor that holds once a batch whose highest new
// sequence is high is durable.
func (f *floorState) checkpoint(high int64) int64 {
	if f.barrier != 0 {
		return f.floor
	}
	return max(f.floor, f.maxHandled, high)
}

// handled records that the batch with checkpoint cp is durable.
func (f *floorState) handled(high, cp int64, spans []span, stored heldSlotState) {
	f.maxHandled = max(f.maxHandled, high)
	f.floor = max(f.floor, cp)
	f.spans, f.stored = spans, stored
	f.pend = f.pend[:0]
}

// wantAckFloor reports whether the server's ack floor should be read now.
func (f *floorState) wantAckFloor(now time.Time) bool {
	if f.barrier == 0 || now.Sub(f.lastCheck) < barrierCheckEvery {
		return false
	}
	f.lastCheck = now
	return true
}

// ackFloor feeds the server's ack floor and the stream sequence the
// consumer has delivered up to, read together after the deliveries seen so
// far: once the ack floor passes the barrier, everything up to the barrier
// is acked and, the consumer sequences since having been contiguous, every
// message seen after it is handled. A barrier left unbounded by a missed
// delivery is first raised to delivered, which is at least that delivery's
// sequence.
func (f *floorState) ackFloor(af, delivered int64) {
	// Whoever handled them, the messages up to the ack floor are acked:
	// with instances sharing the consumer the barrier may rarely clear,
	// but the floor still follows the server's.
	f.floor = max(f.floor, af)
	if f.unbounded {
		f.barrier = max(f.barrier, delivered)
		f.unbounded = false
	}
	if f.barrier != 0 && af >= f.barrier {
		f.floor = max(f.floor, af, f.maxHandled)
		f.barrier = 0
	}
	f.spans = mergeSpans(f.spans, f.floor)
}

// Run consumes until ctx ends or Close is called, then returns nil. It
// returns an error only when the connection was closed under it.
func (s *Source) Run(ctx context.Context, h bridge.Handler) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	if s.running != nil {
		s.mu.Unlock()
		return errors.New("nats source: Run already running")
	}
	ctx, cancel := context.WithCancel(ctx)
	s.cancel, s.running = cancel, make(chan struct{})
	running := s.running
	s.mu.Unlock()
	var bg sync.WaitGroup
	if s.otherBridgesChecked.CompareAndSwap(false, true) {
		bg.Go(func() { s.warnOtherBridgeConsumers(ctx) })
	}
	defer func() {
		cancel()
		bg.Wait()
		s.mu.Lock()
		s.cancel, s.running = nil, nil
		s.mu.Unlock()
		close(running)
	}()

	st := &floorState{}
	bo := backoff{min: 100 * time.Millisecond, max: 10 * time.Second}
	// A stream or consumer that stays missing (deleted, create: false)
	// fails every retry: counted each time, logged once per 30 s.
	var unavailable logthrottle.Throttle
	retryFailed := func(msg string, err error) {
		s.cfg.Metrics.SourceErrors.WithLabelValues(s.cfg.Stream).Inc()
		if suppressed, ok := unavailable.AllowKey(time.Now(), msg+err.Error()); ok {
			s.log.Warn(msg, zap.Error(err), zap.Int("held_back", suppressed))
		}
	}
	// other: the store's floor is of an earlier stream of this name; known:
	// the store had read a stream of this name (see settleIncarnation).
	var other, known bool
	for {
		// The stream's identity now, not as NewSource saw it.
		err := s.reconcile(ctx, false)
		other = false
		if err == nil {
			other, err = s.storedFloor(h, st)
		}
		if err == nil {
			if st.legacy != 0 {
				// Settled in consume, when the legacy floor is kept or
				// dropped.
				s.incDue = s.created.Load()
				known = true
			} else {
				known, err = s.settleIncarnation(ctx, h, s.created.Load(), other)
			}
		}
		if err == nil {
			st.keepIncarnation(s.inc) // the held spans of this incarnation
			err = s.checkRestored(ctx, h, st)
		}
		if err == nil {
			break
		}
		retryFailed("nats source: read stream info or checkpoint failed; retrying", err)
		if !sleepCtx(ctx, retryPause(&bo, err)) {
			return nil
		}
	}
	if !known && !other && st.floor == 0 && st.legacy == 0 {
		s.logUnstored()
	}
	bo.reset()
	streamID := s.created.Load()
	verified := true // the stream's identity is the one st belongs to
	gone := false
	for ctx.Err() == nil {
		if s.nc.IsClosed() {
			return errors.New("nats source: connection closed")
		}
		if !verified {
			// Whatever stopped consuming, the stream may have been
			// deleted and created again meanwhile (by us or an operator,
			// or lost with the server's storage): its sequences start
			// over, and so must the floor.
			if err := s.reconcile(ctx, gone); err != nil {
				retryFailed("nats source: stream or consumer unavailable", err)
				if !sleepCtx(ctx, retryPause(&bo, err)) {
					return nil
				}
				continue
			}
			if id := s.created.Load(); id != streamID {
				if _, err := s.settleIncarnation(ctx, h, id, true); err != nil {
					retryFailed("nats source: the stream was created again; reading its incarnation failed", err)
					if !sleepCtx(ctx, retryPause(&bo, err)) {
						return nil
					}
					continue
				}
				s.log.Warn("nats source: the stream was created again; reading it from its start",
					zap.Int64("floor", st.floor), zap.Time("stream_created", time.Unix(0, id)),
					zap.Time("was_created", time.Unix(0, streamID)), zap.Uint32("incarnation", s.inc))
				*st, streamID = floorState{}, id
				// The deliveries catchFloor waits for were the old
				// stream's: the new one's ack floor may never get there.
				s.catchFloor.Store(0)
				s.key = CheckpointKey(s.cfg.Stream, id, s.subjects())
			} else if err := s.checkRestored(ctx, h, st); err != nil {
				retryFailed("nats source: the stream went back below the floor; storing the new floor failed", err)
				if !sleepCtx(ctx, retryPause(&bo, err)) {
					return nil
				}
				continue
			}
			verified = true
			unavailable.Reset()
		}
		err := s.consume(ctx, h, st, &bo)
		if ctx.Err() != nil {
			return nil
		}
		s.cfg.Metrics.SourceErrors.WithLabelValues(s.cfg.Stream).Inc()
		gone = isConsumerGone(err)
		if gone {
			s.setConsErr(fmt.Errorf("%w: %q on stream %q: %w", ErrNoConsumer, s.cfg.Consumer, s.cfg.Stream, err))
		}
		s.consumingStopped(err)
		if !sleepCtx(ctx, retryPause(&bo, err)) {
			return nil
		}
		verified = false
	}
	return nil
}

// checkRestored handles a stream whose last sequence is below the floor
// (or the highest sequence handled) under the same identity: the stream was
// restored from a backup (nats stream restore, a copy of the server's
// store, a cluster's assignment on a node that lost its disk), which keeps
// its creation time but numbers the messages published since from the
// backup's end. Those would be at or below the floor and acked as held,
// unread. Which of the restored stream's messages are the backup's is not
// known (some new ones may be in already), but the restored consumer's ack
// floor is at most the backup's end: the floor goes back to it, and the
// backup's messages above it are taken in again (a duplicate at worst,
// never a loss). The messages from there on get a new incarnation, so
// replacing by id compares them with the tasks already held by broker
// time, not by sequences that now repeat. Both are stored before consuming
// goes on. A restored stream that has grown past the old floor before this
// check (the bridge down, or not yet delivered to, meanwhile) is not
// detected.
func (s *Source) checkRestored(ctx context.Context, h bridge.Handler, st *floorState) error {
	last := int64(s.lastSeq.Load())
	if st.legacy != 0 || st.maxHeld() <= last {
		return nil
	}
	ref := s.consumer.Load()
	if ref == nil {
		return ErrNoConsumer
	}
	info, err := s.consumerInfo(ctx, ref.c)
	if err != nil {
		return fmt.Errorf("nats source: consumer info: %w", err)
	}
	floor := min(last, int64(info.AckFloor.Stream))
	inc := s.inc + 1
	// The held spans went back with the stream too: cleared.
	held, _ := (&floorState{stored: st.stored}).heldCheckpoints(s.key, inc, nil)
	b := &bridge.Batch{Checkpoints: append([]shard.Checkpoint{
		{Key: s.key, Offset: floor},
		{Key: s.incKey, Offset: int64(inc), Fingerprint: uint64(s.incOf)},
	}, held...)}
	if err := h.Handle(ctx, b); err != nil {
		return fmt.Errorf("nats source: store the floor of a restored stream: %w", err)
	}
	s.log.Warn("nats source: the stream's last sequence is below the floor read so far, its creation time unchanged: restored from a backup? Reading on from the consumer's ack floor, as a new incarnation",
		zap.Uint64("last_seq", uint64(last)), zap.Int64("floor_was", st.floor), zap.Int64("handled", st.maxHandled),
		zap.Int64("floor", floor), zap.Uint32("incarnation", inc))
	s.inc = inc
	*st = floorState{floor: floor}
	s.catchFloor.Store(0) // sequences of before the restore
	return nil
}

// logUnstored, for a store that has never read the stream, says (an
// error line) when the consumer has acked messages of it nonetheless. The
// bridge acks a message only once the store holds it, so the store that
// took in the acked messages is not this one: the tasks pending in it are
// not here. The usual causes are a changed data_dir and a volume that was
// replaced or wiped; the bridge cannot tell them from an intended fresh
// start, so it reads on.
func (s *Source) logUnstored() {
	ref := s.consumer.Load()
	if ref == nil {
		return
	}
	info := ref.c.CachedInfo()
	// The consumer's own sequence, not the stream's: the server starts a
	// new consumer's stream ack floor at its first sequence - 1, which is
	// past 0 on a stream purged or with messages aged out, before anything
	// was delivered or acked.
	if info == nil || info.AckFloor.Consumer == 0 {
		return
	}
	s.log.Error("nats source: the consumer has acked messages of the stream, but the store holds no floor of it: "+
		"the tasks a previous store took in from them are not in this store "+
		"(was data_dir changed, or its volume replaced or wiped?); reading on from the consumer's position",
		zap.Uint64("ack_floor", info.AckFloor.Stream))
}

// reconcile reads the stream's identity now, and when the stream or the
// consumer is gone, looks them up (or creates them) again with ensure.
// A failure shows in Health until consuming works again.
func (s *Source) reconcile(ctx context.Context, gone bool) error {
	if !gone {
		err := s.refreshStream(ctx)
		if err == nil {
			return nil
		}
		if !isConsumerGone(err) {
			s.setConsErr(err)
			return err
		}
	}
	if err := s.ensure(ctx); err != nil {
		s.setConsErr(err)
		return err
	}
	return nil
}

// lookupStream looks the delay stream up as the set-up asks its requests
// (answered), and takes only the leader's answer (streamLeaderErr).
func (s *Source) lookupStream(ctx context.Context) (jetstream.Stream, error) {
	stream, err := answered(ctx, s, func(ctx context.Context) (jetstream.Stream, error) { return s.js.Stream(ctx, s.cfg.Stream) })
	if err != nil {
		return nil, err
	}
	if err := streamLeaderErr(stream.CachedInfo()); err != nil {
		return nil, err
	}
	return stream, nil
}

// refreshStream reads the stream's identity and last sequence now: the
// stream may have been created again, or grown, since ensure. An answer
// without a leader is not taken (ErrNoStreamLeader).
func (s *Source) refreshStream(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.setupBudget())
	defer cancel()
	stream, err := s.lookupStream(ctx)
	if err != nil {
		return fmt.Errorf("nats source: look up stream %q: %w", s.cfg.Stream, err)
	}
	info := stream.CachedInfo()
	s.created.Store(info.Created.UnixNano())
	s.lastSeq.Store(info.State.LastSeq)
	return nil
}

// storedFloor sets s.key for the stream's identity now and reads the floor
// stored under it into st.
//
// Without one, a floor stored under the base key (by an older version) may
// be from a stream since deleted and created again. If its stream
// identity was stored with it (a development version did, under
// createdKey) it counts only for that stream. Otherwise it goes to
// st.legacy, to be kept or dropped against the consumer's state when
// consuming starts (floorState.adoptLegacy). The floor is carried to the
// new key by the first batch.
func (s *Source) storedFloor(h bridge.Handler, st *floorState) (other bool, err error) {
	id := s.created.Load()
	s.key = CheckpointKey(s.cfg.Stream, id, s.subjects())
	floor, ok, err := h.Checkpoint(s.key)
	if err != nil || ok {
		st.floor = floor
		if err == nil {
			err = s.loadHeld(h, st)
		}
		return false, err
	}
	floor, ok, err = h.Checkpoint(s.base)
	if err != nil || !ok || floor <= 0 {
		return false, err
	}
	created, ok, err := h.Checkpoint(createdKey(s.base))
	switch {
	case err != nil:
		return false, err
	case !ok:
		st.legacy = floor
	case created == id:
		st.floor = floor
	default:
		s.log.Warn("nats source: the stream was created again since the store's checkpoint; reading it from its start",
			zap.Int64("checkpoint", floor), zap.Time("checkpoint_stream_created", time.Unix(0, created)),
			zap.Time("stream_created", time.Unix(0, id)))
		return true, nil
	}
	return false, nil
}

// loadHeld reads the spans held above the floor stored under s.key.
func (s *Source) loadHeld(h bridge.Handler, st *floorState) error {
	l, ok := h.(bridge.CheckpointLoader)
	if !ok {
		return nil
	}
	var stored heldSlotState
	for i := range stored.span {
		cp, ok, err := l.LoadCheckpoint(HeldKey(s.key, i))
		if err != nil {
			return fmt.Errorf("nats source: read the sequences held above the floor: %w", err)
		}
		if ok {
			stored.span[i], stored.inc[i] = span{lo: int64(cp.Fingerprint), hi: cp.Offset}, cp.Incarnation
		}
	}
	st.loadHeld(stored)
	return nil
}

func isConsumerGone(err error) bool {
	return errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound) ||
		errors.Is(err, jetstream.ErrStreamNotFound) || errors.Is(err, ErrNoConsumer) || errors.Is(err, ErrNoStream)
}

// consumingStopped notes a stop of the consume (Run's goroutine only),
// logging it as stopLog lets it.
func (s *Source) consumingStopped(err error) {
	s.stopRun = true
	if suppressed, ok := s.stopLog.AllowKey(s.stopClock(), err.Error()); ok {
		s.stopEp.Logged()
		s.log.Warn("nats source: consuming stopped; restarting", zap.Error(err), zap.Int("held_back", suppressed))
	}
}

// consumingAgain ends a run of stops (Run's goroutine only), saying why
// as stopEp lets it: at once if a stop line was logged since the last
// end line.
func (s *Source) consumingAgain(why string) {
	if !s.stopRun {
		// Runs whose end lines were held back, their interval over
		// (logthrottle.Episode.Owed).
		if held, ok := s.stopEp.Owed(s.stopClock()); ok {
			s.log.Info("nats source: consuming again: "+why, zap.Int("held_back", held))
		}
		return
	}
	s.stopRun = false
	if held, ok := s.stopEp.End(s.stopClock()); ok {
		s.log.Info("nats source: consuming again: "+why, zap.Int("held_back", held))
	}
}

func (s *Source) stopClock() time.Time {
	if s.stopNow != nil {
		return s.stopNow()
	}
	return time.Now()
}

// consume pulls and hands over batches until it fails or ctx ends.
func (s *Source) consume(ctx context.Context, h bridge.Handler, st *floorState, bo *backoff) error {
	ref := s.consumer.Load()
	if ref == nil {
		return ErrNoConsumer
	}
	cons := ref.c
	if err := s.awaitDeadLetters(ctx, h); err != nil {
		return err
	}
	info, err := s.consumerInfo(ctx, cons)
	if err != nil {
		return s.consumerUnread(ctx, fmt.Errorf("nats source: consumer info: %w", err))
	}
	s.consErr.Store(nil)
	s.setAckWait(info.Config)
	// Messages a previous run received and did not acknowledge (nak'd at
	// its stop, or in flight at a crash) are ack-pending, not pending:
	// they are read again before it counts as caught up, by a batch that
	// leaves nothing pending.
	if info.NumPending == 0 && info.NumAckPending == 0 {
		s.reachedEnd()
	} else if !s.caughtUp.Closed() && info.AckFloor.Stream < info.Delivered.Stream {
		s.catchFloor.Store(max(s.catchFloor.Load(), int64(info.Delivered.Stream)))
	}
	if s.incDue != 0 {
		// A legacy floor to be dropped was likely another stream's: its
		// tasks are the previous incarnation. Duplicates of what the
		// consumer redelivers are the price if it was not; new messages
		// lost to old tasks with the same ids the price of the other way.
		if _, err := s.settleIncarnation(ctx, h, s.incDue, st.legacyOther(int64(info.Delivered.Stream))); err != nil {
			return err
		}
	}
	if st.legacy != 0 {
		legacy := st.legacy
		if st.adoptLegacy(int64(info.Delivered.Stream)) {
			s.log.Info("nats source: kept the checkpoint of an older version (no stream identity): the consumer has delivered past it",
				zap.Int64("checkpoint", legacy), zap.Uint64("delivered", info.Delivered.Stream))
		} else {
			s.log.Warn("nats source: dropped the checkpoint of an older version (no stream identity): the consumer has not delivered that far, so the stream may have been created again; what it redelivers may be ingested twice",
				zap.Int64("checkpoint", legacy), zap.Uint64("delivered", info.Delivered.Stream))
		}
	}
	st.start(int64(info.AckFloor.Stream), int64(info.Delivered.Stream), info.Delivered.Consumer)
	s.lastReset = time.Now()
	s.nakUnseen(ctx, st, info.Delivered.Consumer, true)
	// Within the consumer's own request limits (set by an operator, or by
	// the server's jetstream.limits.max_request_batch): a pull above one
	// of them is refused 409. Messages only, no byte limit in the request
	// (a pull with max_bytes ends with a status, and a message over half
	// the limit would never fit one), but few enough that messages of
	// max_payload stay within PullBytes (see pullMessages): 512 of 1 MiB
	// were 512 MiB of memory.
	pullMsgs, expiry := pullMessages(2*s.cfg.BatchSize, s.cfg.PullBytes, s.nc.MaxPayload()), s.cfg.PullExpiry
	if lim := info.Config.MaxRequestBatch; lim > 0 && pullMsgs > lim {
		pullMsgs = lim
	}
	if lim := info.Config.MaxRequestExpires; lim > 0 && expiry > lim {
		expiry = lim
	}
	p := newPuller(s.nc, s.cfg.Stream, s.cfg.Consumer, pullMsgs, expiry)
	// On an idle stream no batch ends a run of stops: the server serving
	// a pull (its idle heartbeat, its expiry) does (review F211: "consuming
	// again" waited for the next message, maybe hours).
	p.answered = func() { s.consumingAgain("the server answered a pull after consuming stopped") }
	var abandoned []jetstream.Msg
	defer func() {
		// Received and not handled: asked back now rather than after
		// AckWait (30 s by default: on every restart, messages due sooner
		// fired that late). The subscription is gone first, or the server
		// would hand them straight back to a pull of it.
		left := p.close()
		nakAll(abandoned)
		nakAll(left)
	}()

	batch := make([]jetstream.Msg, 0, s.cfg.BatchSize)
	items := make([]bridge.Item, 0, s.cfg.BatchSize)
	for {
		batch = batch[:0]
		nextErr := s.collect(ctx, p, &batch)
		if len(batch) > 0 {
			// The next pull goes out before the batch is made durable, so
			// its messages come in meanwhile.
			if err := p.topUp(); err != nil && nextErr == nil {
				nextErr = err
			}
			p.setAway(true)
			err := s.process(ctx, h, cons, st, batch, items[:0], p.keepAside)
			p.setAway(false)
			if err != nil {
				var ab *abandonedError
				if errors.As(err, &ab) {
					abandoned = ab.batch
					return ab.err
				}
				return err
			}
			bo.reset()
			s.consumingAgain("a batch was taken in after consuming stopped")
		}
		if nextErr == nil {
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		switch {
		case errors.Is(nextErr, errMissedHeartbeat):
			// Quiet or broken? A connection that does not answer a ping
			// is dead though still open (half-open: a NAT or firewall
			// that dropped its state, a frozen host); nats.go would find
			// out only after 2 unanswered pings 2 min apart, and the
			// source would take nothing in meanwhile (review R156).
			// (Not while nats.go is reconnecting: it is on it.)
			if err := s.nc.FlushTimeout(s.cfg.ConnectTimeout); errors.Is(err, natsgo.ErrTimeout) && s.nc.IsConnected() && ctx.Err() == nil {
				s.log.Warn("nats source: no heartbeat from the pulls and no answer to a ping; reconnecting",
					zap.Duration("waited", s.cfg.ConnectTimeout), zap.Error(err))
				_ = s.nc.ForceReconnect()
				return s.consumerUnread(ctx, fmt.Errorf("nats source: no heartbeat, no answer to a ping: %w", err))
			}
			// Ask the server whether the consumer is there.
			if _, err := cons.Info(ctx); err != nil {
				return s.consumerUnread(ctx, fmt.Errorf("nats source: no heartbeat, consumer info: %w", err))
			}
			fallthrough
		case errors.Is(nextErr, errReset):
			p.reset()
			s.lastReset = time.Now()
			// What the old pulls delivered and the source never
			// received is asked back now, not after AckWait.
			if info, err := cons.Info(ctx); err == nil {
				dseq, seq := p.asideHigh()
				st.resumed(int64(info.Delivered.Stream), info.Delivered.Consumer, dseq, seq)
				s.nakUnseen(ctx, st, info.Delivered.Consumer, true)
			}
		default:
			return fmt.Errorf("nats source: next message: %w", nextErr)
		}
	}
}

// consumerInfo asks the server for cons's info as the set-up asks its
// requests (answered): sent again every resendEvery while unanswered,
// within setupBudget. It is asked right after a re-set-up, which is when
// a cluster's quorum may just have come back: a request sent before the
// consumer's leader was elected is answered by no server, and with one
// request (nats.go's 5 s default timeout) consuming started up to 5 s
// late, then stopped and was tried again after the backoff
// (TestConsumeInfoSentAgain).
func (s *Source) consumerInfo(ctx context.Context, cons jetstream.Consumer) (*jetstream.ConsumerInfo, error) {
	ctx, cancel := context.WithTimeout(ctx, s.setupBudget())
	defer cancel()
	return answered(ctx, s, cons.Info)
}

// consumerUnread reports err, a failed consumer info, in Health (so the
// bridge is not ready) unless ctx ended: the source cannot consume (a
// cluster without quorum answers 503 for the consumer, even while a
// replica still answers for the stream). The next consume that reads the
// consumer clears it.
func (s *Source) consumerUnread(ctx context.Context, err error) error {
	if ctx.Err() == nil {
		s.setConsErr(err)
	}
	return err
}

// errConsumerSeqBack: a delivery's consumer sequence is not above the last
// one seen.
var errConsumerSeqBack = errors.New("nats source: consumer sequence went back (consumer or stream created again?)")

// abandonedError carries a batch given up unhandled (ctx ended, or a
// delivery that belongs to another consumer).
type abandonedError struct {
	err   error
	batch []jetstream.Msg
}

func (e *abandonedError) Error() string { return "nats source: batch abandoned: " + e.err.Error() }
func (e *abandonedError) Unwrap() error { return e.err }

// nakAll asks for the redelivery of msgs now rather than after AckWait.
// A nak lost on the way (connection gone) leaves AckWait to do it.
func nakAll(msgs []jetstream.Msg) {
	for _, m := range msgs {
		_ = m.Nak()
	}
}

// maxUnseenNaks bounds the naks nakUnseen sends at once; sequences beyond
// it come back after AckWait.
const maxUnseenNaks = 4096

// nakUnseen asks the server to redeliver now the stream sequences st
// found delivered to this source and never received: in flight at a
// crash or a restart, or on a connection lost at a reconnect. The server
// would redeliver them only after AckWait (30 s by default), and a task
// due meanwhile would fire that late.
//
// Their reply subjects never arrived, so the nak goes to the consumer's
// ack subject built from the sequences (the form every JetStream server
// subscribes: $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.
// <consumer seq>.<time>.<pending>). The server redelivers a nak'd stream
// sequence that is still pending, and ignores one that is not (acked
// meanwhile, or not of this consumer's subjects); the consumer sequence
// must be one it delivered and not acked: dseq, a delivery of the batch in
// hand or the consumer's last one. A nak lost on the way, or one a
// server ignores, leaves it to AckWait, as before.
//
// The server applies acks and naks on a queue of their own, apart from
// pull requests: a pull sent right after the naks may be served new
// messages before the naks are applied, and the messages asked back then
// come after them (seen under CPU load: TestSourceStopNaksPrefetched
// handled 3 4 1 2 5). So the last nak is sent as a request: the server
// answers it once it has applied it, and every nak sent before it on the
// connection, and the source pulls only then (nakFenceWait at most: a nak
// not answered in time costs the order, not a message). Only with fence:
// when no pull is live (a consume's start, the pulls reset), so there is
// an order to keep.
//
// With another client on the same consumer (unsupported) what looks
// unseen may be in its hands: nak'd, it is handed out again, and may be
// taken in by both (see checkGaps).
func (s *Source) nakUnseen(ctx context.Context, st *floorState, dseq uint64, fence bool) {
	unseen := st.takeUnseen()
	if len(unseen) == 0 || s.noNaks {
		return
	}
	var seqs []int64
	for _, sp := range unseen {
		for seq := sp.lo; seq <= sp.hi && len(seqs) < maxUnseenNaks; seq++ {
			seqs = append(seqs, seq)
		}
	}
	prefix := "$JS.ACK." + s.cfg.Stream + "." + s.cfg.Consumer + ".1."
	suffix := "." + strconv.FormatUint(dseq, 10) + ".0.0"
	nak := []byte("-NAK")
	for i, seq := range seqs {
		subject := prefix + strconv.FormatInt(seq, 10) + suffix
		var err error
		if i < len(seqs)-1 || !fence {
			err = s.nc.Publish(subject, nak)
		} else if err = s.nakFence(ctx, subject, nak); err != nil && !errors.Is(err, natsgo.ErrConnectionClosed) {
			s.log.Debug("nats source: the last nak of the unseen deliveries not answered; they may come back after newer messages", zap.Error(err))
			err = nil // sent, or lost: the order is what was at stake
		}
		if err != nil {
			s.log.Debug("nats source: nak of an unseen delivery not sent; redelivered after ack wait", zap.Error(err))
			return
		}
	}
	s.log.Info("nats source: asked the server to redeliver now what it delivered and the source never received (in flight at a restart or a reconnect)",
		zap.Int64("from_seq", unseen[0].lo), zap.Int64("to_seq", unseen[len(unseen)-1].hi), zap.Int("naks", len(seqs)))
}

// nakFenceWait bounds how long nakUnseen waits for the server's answer to
// its last nak before the source pulls.
var nakFenceWait = time.Second

// nakFence sends the last nak of nakUnseen as a request and waits for the
// server's answer, nakFenceWait at most, or until ctx ends (a stop does not
// wait for it: the nak is sent either way).
func (s *Source) nakFence(ctx context.Context, subject string, nak []byte) error {
	if ctx.Err() != nil {
		// Stopping: a request would not even be sent.
		return s.nc.Publish(subject, nak)
	}
	ctx, cancel := context.WithTimeout(ctx, nakFenceWait)
	defer cancel()
	_, err := s.nc.RequestWithContext(ctx, subject, nak)
	return err
}

// sharedGapAfter: one bridge misses deliveries only down a connection it
// loses, which resets its pulls, and on a server with leaf nodes or
// gateways for up to 2 s after a reset (nats-server still delivers to a
// pull request younger than that whose subscriber is gone). A gap seen
// longer than this after the last reset or start is another client's.
var sharedGapAfter = 10 * time.Second

// checkGaps warns (at most every 30 s) when the batch just seen had gaps
// in consumer sequences long after the last reset: another client takes
// deliveries of the consumer. Unsupported: each takes in only what the
// server hands it, so cancels and replaces miss the tasks the other holds,
// and what one asks back as lost (nakUnseen) may be in the other's hands
// and is then taken in by both.
func (s *Source) checkGaps(st *floorState) {
	if st.gaps == 0 {
		return
	}
	gaps := st.gaps
	st.gaps = 0
	if time.Since(s.lastReset) <= sharedGapAfter {
		return
	}
	if suppressed, ok := s.foreignLog.Allow(time.Now()); ok {
		s.log.Warn("nats source: deliveries of the consumer went to another client; run one bridge per consumer (two releases with the same nats.consumer on one stream?): each takes in only what the server hands it, so cancels and replaces miss the tasks the other holds, and messages asked back as lost may be taken in by both",
			zap.Int("gaps", gaps), zap.Int("held_back", suppressed))
	}
}

// collect appends to batch the next message (waiting for it) and whatever
// follows within Linger, up to BatchSize. The error is the one that ended
// the wait for the first message, or a terminal one seen while lingering.
func (s *Source) collect(ctx context.Context, p *puller, batch *[]jetstream.Msg) error {
	m, err := p.next(ctx)
	if err != nil {
		return err
	}
	*batch = append(*batch, m)
	size := msgBytes(m)
	if len(*batch) >= s.cfg.BatchSize || size >= s.cfg.BatchBytes {
		return nil
	}
	lctx, cancel := context.WithTimeout(ctx, s.cfg.Linger)
	defer cancel()
	for len(*batch) < s.cfg.BatchSize && size < s.cfg.BatchBytes {
		m, err := p.next(lctx)
		if err != nil {
			if lctx.Err() != nil && ctx.Err() == nil {
				return nil // linger over
			}
			return err
		}
		*batch = append(*batch, m)
		size += msgBytes(m)
	}
	return nil
}

// pullFraming bounds what a delivered message carries beyond its
// max_payload (headers and data): its subject and reply subject.
const pullFraming = 4 << 10

// pullMessages is how many messages a pull asks for: want (2 x BatchSize),
// or fewer if that many messages of maxPayload would be more than
// pullBytes, at least 2. The bound holds for messages up to the
// max_payload read when the source starts pulling; a larger one
// (max_payload raised while the bridge runs, or lowered after it was
// stored) still comes through, the pull having no byte limit.
func pullMessages(want, pullBytes int, maxPayload int64) int {
	per := min(max(maxPayload, 0), 1<<40) + pullFraming
	return max(2, min(want, int(int64(pullBytes)/per)))
}

// msgBytes is what a batch counts for m: its data and its headers' names
// and values, each header with the codec.Header it becomes.
func msgBytes(m jetstream.Msg) int {
	n := len(m.Data())
	for k, vs := range m.Headers() {
		for _, v := range vs {
			n += len(k) + len(v) + codec.HeaderMemory
		}
	}
	return n
}

// process hands the batch to the handler (retrying until it succeeds or
// ctx ends) and acks it. aside, if not nil, is called with each keep-alive
// of the batch (see handle).
func (s *Source) process(ctx context.Context, h bridge.Handler, cons jetstream.Consumer, st *floorState, batch []jetstream.Msg, items []bridge.Item, aside func()) error {
	var high int64
	var pending uint64
	sawMeta := false
	for _, m := range batch {
		md, err := m.Metadata()
		if err != nil {
			// Not a JetStream delivery; nothing to ack, nothing to store.
			s.log.Error("nats source: message without jetstream metadata; ignored", zap.String("subject", m.Subject()), zap.Error(err))
			continue
		}
		seq := int64(md.Sequence.Stream)
		pending, sawMeta = md.NumPending, true
		if md.Sequence.Consumer <= st.lastDseq {
			// Consumer sequences only grow: this is another consumer of
			// the same name, e.g. on a stream created again (storage lost,
			// a new cluster) while the pulls rode out a reconnect.
			// Nothing of the batch is taken or acked as held until Run
			// has checked the stream's identity.
			return &abandonedError{err: fmt.Errorf("%w: delivery %d after %d", errConsumerSeqBack, md.Sequence.Consumer, st.lastDseq), batch: batch}
		}
		if st.see(md.Sequence.Consumer, seq, md.NumDelivered <= 1) {
			continue // already held (e.g. before a crash): acked below, not handed over
		}
		if serverMarker(m) {
			// Acked below, not handed over: not a publisher's message.
			s.log.Debug("nats source: server marker skipped", zap.String("subject", m.Subject()),
				zap.Int64("seq", seq), zap.String("reason", m.Headers().Get(markerReason)))
			high = max(high, seq)
			continue
		}
		rules, ok := rulesFor(s.cfg.Sources, m.Subject())
		if !ok {
			// Only if the consumer's filter was widened after start. Taking
			// the first source's rules (and its DLQ) beats stalling.
			rules = s.cfg.Sources[0].Rules
			if held, ok := s.noSourceLog.Allow(time.Now()); ok {
				s.log.Warn("nats source: subject matches no configured source; using the first source's rules",
					zap.String("subject", m.Subject()), zap.Int("held_back", held))
			}
		}
		items = append(items, bridge.Item{
			Msg: codec.Message{
				Transport:   codec.TransportNATS,
				Source:      s.cfg.Stream,
				Partition:   0,
				Incarnation: s.inc,
				Offset:      seq,
				Value:       m.Data(),
				Headers:     headersIn(m.Headers()),
				Time:        md.Timestamp,
			},
			Rules: rules,
		})
		high = max(high, seq)
	}
	s.lag.Set(float64(pending))
	s.nakUnseen(ctx, st, st.lastDseq, false) // the pulls are live: nothing to order
	s.checkGaps(st)

	if len(items) > 0 {
		// Redeliveries (after a nak or AckWait) need not come in stream
		// order; within a batch the handler sees source order again.
		// A message redelivered while its first copy waited in the buffer
		// may be here twice: hand it over once.
		if !slices.IsSortedFunc(items, byOffset) {
			slices.SortStableFunc(items, byOffset)
		}
		items = slices.CompactFunc(items, func(a, b bridge.Item) bool { return a.Msg.Offset == b.Msg.Offset })
		cp := st.checkpoint(high)
		spans := st.nextSpans(cp)
		heldCps, stored := st.heldCheckpoints(s.key, s.inc, spans)
		b := &bridge.Batch{Items: items, Checkpoints: append([]shard.Checkpoint{
			{Key: s.key, Offset: cp},
			{Key: s.incKey, Offset: int64(s.inc), Fingerprint: uint64(s.incOf)},
		}, heldCps...)}
		stopLag := s.refreshLagWhile(ctx, cons)
		err := s.handle(ctx, h, b, batch, aside)
		stopLag()
		if err != nil {
			return &abandonedError{err: err, batch: batch}
		}
		st.handled(high, cp, spans, stored)
	} else {
		st.commitPend()
	}
	if sawMeta && pending == 0 {
		s.atEnd(ctx, cons) // the batch is stored: nothing more was pending
	}
	for _, m := range batch {
		if err := m.Ack(); err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
			// Redelivered later and skipped or re-ingested; never lost.
			s.log.Debug("nats source: ack failed", zap.Error(err))
		}
	}
	if st.wantAckFloor(time.Now()) {
		if info, err := cons.Info(ctx); err == nil {
			st.ackFloor(int64(info.AckFloor.Stream), int64(info.Delivered.Stream))
		}
	}
	return nil
}

// lagRefresh is how often a source held by its handler (a batch whose
// dead letters wait for a DLQ that cannot be written) reads the consumer's
// pending count, so delaybridge_source_lag_messages keeps counting what is
// published meanwhile instead of freezing at the last batch's metadata.
var lagRefresh = time.Second

// refreshLagWhile sets the lag gauge from the consumer's info every
// lagRefresh until stop is called.
func (s *Source) refreshLagWhile(ctx context.Context, cons jetstream.Consumer) (stop func()) {
	if cons == nil {
		return func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(lagRefresh)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				if info, err := cons.Info(ctx); err == nil {
					// Delivered but not acked (the held batch, and what
					// the pulls brought in behind it) is not taken in
					// either.
					s.lag.Set(float64(info.NumPending + uint64(info.NumAckPending)))
				}
			}
		}
	}()
	return func() { cancel(); <-done }
}

func byOffset(a, b bridge.Item) int { return cmp.Compare(a.Msg.Offset, b.Msg.Offset) }

// markerReason is the header of the messages the server itself stores in
// a stream: a subject delete marker when a subject's last message ages
// out (subject_delete_marker_ttl), or a message with a per-message TTL
// expires ("MaxAge", "Remove", "Purge").
const markerReason = "Nats-Marker-Reason"

// serverMarker reports whether m is such a marker: empty, with the
// header. A delay stream with markers on stores them among the delay
// subjects; taken in, each would be dead-lettered missing-due, once per
// subject whose last message aged out.
func serverMarker(m jetstream.Msg) bool {
	return len(m.Data()) == 0 && m.Headers().Get(markerReason) != ""
}

// handle calls h.Handle until it succeeds or ctx ends. Meanwhile the batch
// is marked in progress every third of the consumer's redelivery wait (see
// keepAlivePeriod), so a slow or failing handler does not make the server
// redeliver what it is still working on; aside (if not nil) is called at
// each mark, for what the pulls brought in behind the batch (see
// puller.keepAside).
func (s *Source) handle(ctx context.Context, h bridge.Handler, b *bridge.Batch, batch []jetstream.Msg, aside func()) error {
	k := startKeepAlive(batch, s.keepAlivePeriod(), aside)
	defer k.stop()
	bo := backoff{min: 100 * time.Millisecond, max: 10 * time.Second}
	for {
		err := h.Handle(ctx, b)
		if err == nil {
			tries := s.handleTries
			s.handleTries = 0
			if tries > 0 {
				if held, ok := s.handleEp.End(time.Now()); ok {
					s.log.Info("nats source: batches stored again", zap.Int("failed_tries", tries), zap.Int("held_back", held))
				}
			} else if held, ok := s.handleEp.Owed(time.Now()); ok {
				// Runs whose end lines were held back, their interval
				// over (logthrottle.Episode.Owed).
				s.log.Info("nats source: batches stored again", zap.Int("held_back", held))
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		s.handleTries++
		s.cfg.Metrics.SourceErrors.WithLabelValues(s.cfg.Stream).Inc()
		d := bo.next()
		if suppressed, forgotten, ok := s.handleLog.AllowEachForgotten(time.Now(), logthrottle.Shape(err.Error())); ok {
			s.handleEp.Logged()
			s.log.Warn("nats source: handle batch failed; not acked, retrying",
				zap.Int("messages", len(b.Items)), zap.Duration("backoff", d), zap.Error(err), zap.Int("held_back", suppressed), logthrottle.Forgotten(forgotten))
		}
		if !sleepCtx(ctx, d) {
			return ctx.Err()
		}
	}
}

// keepAlive sends "in progress" for a batch every period until stopped:
// one timer per batch, re-armed by its own callback.
type keepAlive struct {
	mu      sync.Mutex
	t       *time.Timer
	msgs    []jetstream.Msg
	also    func()
	period  time.Duration
	stopped bool
}

func startKeepAlive(msgs []jetstream.Msg, period time.Duration, also func()) *keepAlive {
	k := &keepAlive{msgs: msgs, period: period, also: also}
	k.mu.Lock() // the callback waits until k.t is set
	k.t = time.AfterFunc(period, k.fire)
	k.mu.Unlock()
	return k
}

func (k *keepAlive) fire() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.stopped {
		return
	}
	for _, m := range k.msgs {
		_ = m.InProgress()
	}
	if k.also != nil {
		k.also()
	}
	k.t.Reset(k.period)
}

func (k *keepAlive) stop() {
	k.mu.Lock()
	k.stopped = true
	k.t.Stop()
	k.mu.Unlock()
}

// backoff is exponential with +-20% jitter.
type backoff struct {
	min, max, cur time.Duration
}

func (b *backoff) next() time.Duration {
	b.grow()
	return b.jittered()
}

// nextUpTo is next for a failure retried within limit: the step grows
// as next's up to limit, not past it (one grown past it by other
// failures is kept), and the wait is at most limit.
func (b *backoff) nextUpTo(limit time.Duration) time.Duration {
	if b.cur < limit {
		b.grow()
		b.cur = min(b.cur, limit)
	}
	return min(b.jittered(), limit)
}

func (b *backoff) grow() {
	if b.cur == 0 {
		b.cur = b.min
	} else {
		b.cur = min(2*b.cur, b.max)
	}
}

// jittered is the step, ±20%.
func (b *backoff) jittered() time.Duration {
	j := 0.8 + 0.4*rand.Float64()
	return time.Duration(float64(b.cur) * j)
}

func (b *backoff) reset() { b.cur = 0 }

// sleepCtx waits d or until ctx ends; false means ctx ended.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
