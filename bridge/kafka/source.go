package kafka

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol"
	fetchAPI "github.com/segmentio/kafka-go/protocol/fetch"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/delaybridge/delaybridge/bridge"
	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/metrics"
	"github.com/delaybridge/delaybridge/shard"
)

// Source consumes the configured delay topics as a member of a consumer
// group. It implements bridge.Source and bridge.Healther.
type Source struct {
	cfg    Config
	topics []string
	rules  map[string]*codec.Rules
	log    *zap.Logger
	// notReady throttles awaitTopics' line: a missing delay topic fails
	// every retry for as long as it is missing. Keyed by the error's
	// shape: a connection reset or a read timeout names the client's
	// ephemeral port, new at each retry (review R210: keyed by its text,
	// every such retry logged its own line).
	notReady logthrottle.Throttle
	// retries throttles the partition workers' retry lines of fetches,
	// log checks and start positions per topic across its partitions, and says when
	// they all read again (see retryLog); handleFails those of a handler
	// that fails (a store that refuses writes fails every partition's
	// batch at every retry).
	retries, handleFails retryLog
	// commitLines: the offset commits' failure and end lines, across
	// generations (see newGenCommitter).
	commitLines commitLines

	transport *kafkago.Transport
	client    *kafkago.Client
	// pools drops the transport's connection pools on stale metadata
	// (pools.go).
	pools poolDrops

	mu      sync.Mutex
	health  map[string]error // "group" or a checkpoint key -> last error
	running bool
	// unstored holds the checkpoint keys already logged as committed by
	// the group but unknown to the store (see decideStart): once each.
	unstored map[string]bool

	closeOnce sync.Once
	closed    chan struct{}
	runDone   chan struct{} // closed when the running Run returns

	// caughtUp is closed once every partition of a generation was read up
	// to its end (see CaughtUp): caughtUpWant the checkpoint keys of the
	// generation's partitions, caughtUpHad those that got there (under mu).
	caughtUp     bridge.Signal
	caughtUpWant []string
	caughtUpHad  map[string]bool

	// mem is the budget of fetched records not yet stored, shared by
	// every partition of every delay topic (fetchmem.go).
	mem *fetchMem

	// testHookFetched, when set, sees each fetch of a partition worker:
	// the byte limit it asked for and the bytes of records it decoded.
	testHookFetched func(limit, decoded int)
	// now is the clock of the transaction stall gauge (time.Now; tests
	// set it before Run).
	now func() time.Time
	// joinWaitLog is how long a join may take before it is logged
	// (joinWaitLogAfter; tests lower it).
	joinWaitLog time.Duration
}

// joinWaitLogAfter: a join of the group that takes longer is logged. A
// member that stopped without leaving (kill -9, an OOM kill, a lost node)
// stays in the group until its session times out, and the coordinator
// holds the rebalance, and every new member's join, until then: after a
// crash the restarted bridge takes nothing in for up to
// its session timeout (30 s), ready and otherwise silent.
const joinWaitLogAfter = 5 * time.Second

var (
	_ bridge.Source     = (*Source)(nil)
	_ bridge.Healther   = (*Source)(nil)
	_ bridge.CatchingUp = (*Source)(nil)
)

// CaughtUp is closed once the partitions of a generation of this member
// have each been read (and their messages stored) up to the end of their
// log as a fetch found it (the last stable offset: read_committed reads no
// further), or at once for a generation that assigns this member none.
func (s *Source) CaughtUp() <-chan struct{} { return s.caughtUp.C() }

// wantCaughtUp starts watching the partitions of a new generation.
func (s *Source) wantCaughtUp(gen *kafkago.Generation) {
	s.mu.Lock()
	s.caughtUpWant = s.caughtUpWant[:0]
	for topic, parts := range gen.Assignments {
		for _, pa := range parts {
			s.caughtUpWant = append(s.caughtUpWant, CheckpointKey(topic, pa.ID))
		}
	}
	s.mu.Unlock()
	s.checkCaughtUp()
}

// reachedEnd records that the partition of key was read to its end.
func (s *Source) reachedEnd(key string) {
	s.mu.Lock()
	if s.caughtUpHad == nil {
		s.caughtUpHad = make(map[string]bool)
	}
	s.caughtUpHad[key] = true
	s.mu.Unlock()
	s.checkCaughtUp()
}

func (s *Source) checkCaughtUp() {
	if s.caughtUp.Closed() {
		return
	}
	s.mu.Lock()
	all := true
	for _, k := range s.caughtUpWant {
		all = all && s.caughtUpHad[k]
	}
	s.mu.Unlock()
	if all {
		s.log.Info("caught up: every assigned partition read to its end")
		s.caughtUp.Close()
	}
}

// NewSource validates cfg and builds a Source. It does no I/O; Check and Run
// connect.
func NewSource(cfg Config) (*Source, error) {
	cfg.setDefaults()
	if err := cfg.validate(true); err != nil {
		return nil, err
	}
	s := &Source{
		cfg:    cfg,
		rules:  make(map[string]*codec.Rules, len(cfg.Sources)),
		log:    cfg.Logger.With(zap.String("component", "kafka-source"), zap.String("group", cfg.Group)),
		health: make(map[string]error),
		closed: make(chan struct{}),
		now:    time.Now,

		joinWaitLog: joinWaitLogAfter,

		retries:     retryLog{end: "partitions read again: no partition of the source fails to fetch any more"},
		handleFails: retryLog{end: "batches stored again: no partition of the source fails to store its batch any more", anyTopic: true},
	}
	for _, sc := range cfg.Sources {
		s.topics = append(s.topics, sc.Topic)
		s.rules[sc.Topic] = sc.Rules
	}
	s.transport = cfg.transport()
	// The source asks about its own topics only (fetches, offsets, and the
	// group, which needs no topic): its transport's metadata is theirs, not
	// the whole cluster's. Each pool the transport drops (one per fetch that
	// found the metadata stale) stays in memory up to transportIdle with
	// that metadata: 640 KB a drop on a cluster of 2 000 partitions (hunt
	// H208), now a few KB.
	s.transport.MetadataTopics = slices.Clone(s.topics)
	s.client = &kafkago.Client{Addr: kafkago.TCP(cfg.Brokers...), Transport: s.transport}
	s.mem = newFetchMem(cfg.FetchMemory, cfg.Metrics.SourceFetchMemory.WithLabelValues("counted"),
		cfg.Metrics.SourceFetchMemory.WithLabelValues("stuck"), cfg.Metrics.SourceFetchMemoryWaits)
	cfg.Metrics.SourceFetchMemoryLimit.Set(float64(s.mem.limit))
	return s, nil
}

// CheckpointKey is the store checkpoint key of a topic partition.
func CheckpointKey(topic string, partition int) string {
	return bridge.KafkaCheckpointKey(topic, partition)
}

// Check connects to the brokers, authenticates and reads the metadata of
// the source topics. Wrong credentials wrap ErrAuth, TLS failures ErrTLS,
// no answering broker ErrUnreachable.
func (s *Source) Check(ctx context.Context) error {
	return check(ctx, &s.cfg, s.topics)
}

// Health reports why the source cannot make progress (group join failing,
// fetches failing), or nil.
func (s *Source) Health() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	keys := make([]string, 0, len(s.health))
	for k := range s.health {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var errs []error
	for _, k := range keys {
		errs = append(errs, s.health[k])
	}
	return errors.Join(errs...)
}

func (s *Source) setHealth(key string, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err == nil {
		delete(s.health, key)
		return
	}
	s.health[key] = err
}

// Close stops Run and waits for it to return. It is safe to call more than
// once and without Run.
func (s *Source) Close() error {
	s.closeOnce.Do(func() { close(s.closed) })
	s.mu.Lock()
	done := s.runDone
	s.mu.Unlock()
	if done != nil {
		<-done
	}
	s.transport.CloseIdleConnections()
	return nil
}

// Run consumes until ctx is cancelled or Close is called, then leaves the
// group and returns nil. It returns an error when the brokers refuse the
// configuration before the group was first joined (ErrAuth: credentials,
// topic or group authorization; ErrTLS); an unreachable broker, and any
// failure after the first join, is retried and reported by Health.
func (s *Source) Run(ctx context.Context, h bridge.Handler) error {
	s.mu.Lock()
	if s.running {
		s.mu.Unlock()
		return ErrRunning
	}
	select {
	case <-s.closed:
		s.mu.Unlock()
		return ErrClosed
	default:
	}
	s.running = true
	s.runDone = make(chan struct{})
	done := s.runDone
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.running = false
		s.mu.Unlock()
		close(done)
	}()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.closed:
			cancel()
		case <-ctx.Done():
		}
	}()

	// A group reads the source topics that exist: while one is missing (at
	// start, or deleted while we run) the others go on, the source reports
	// the missing one (not ready), and watchTopics ends the group once it
	// exists, so that the next joins with every topic. kafka-go's group
	// cannot take a missing topic: it assigns no partition of any topic
	// and starts a new generation in a tight loop.
	var (
		workers     sync.WaitGroup
		cg          *kafkago.ConsumerGroup
		groupCtx    context.Context
		groupCancel context.CancelFunc = func() {}
		topics      []string           // the group's
		missingErr  error              // the topics it lacks, or nil
	)
	// leave stops the group's partition workers (they watch groupCtx) and
	// lets them commit what they stored, then closes the group: closing it
	// first would end the generation under them and skip that last
	// commit. Close leaves the group. Also on return.
	leave := func() {
		groupCancel()
		workers.Wait()
		if cg != nil {
			c := cg
			cg = nil
			// kafka-go's Close waits for a JoinGroup in flight, which the
			// coordinator answers only when the rebalance completes (up
			// to RebalanceTimeout). Running, the next group waits for it
			// (a leave for a topic change); stopping, at most leaveWait,
			// also when the stop comes during such a wait: the workers
			// have committed, so the shutdown is not held for the leave.
			closed := make(chan struct{})
			go func() { _ = c.Close(); close(closed) }()
			select {
			case <-closed:
				return
			case <-ctx.Done():
			}
			select {
			case <-closed:
			case <-time.After(leaveWait):
				s.log.Warn("leaving the consumer group: a join in flight holds it; not waiting for it")
			}
		}
	}
	defer func() { leave() }()
	// member is the member id of the last generation joined, until
	// kafka-go drops it; the removals of dropped ones run in stale.
	var member string
	var stale sync.WaitGroup
	// A removal still retrying when Run returns (a start refused, say)
	// ends with it rather than hold the return for its deadline.
	staleCtx, stopStale := context.WithCancel(ctx)
	defer func() { stopStale(); stale.Wait() }()
	if m := s.readMemberFile(); m != "" {
		// The membership of this bridge's previous run, which it left
		// already if it stopped cleanly (then the removal finds no such
		// member), not if it crashed.
		stale.Go(func() { s.removeStaleMember(staleCtx, m, "the previous run's membership, left by a crash") })
	}
	joined := false
	var joinFails logthrottle.Throttle // one line per logthrottle.DefaultEvery and error shape (ports aside) while joins fail
	var genEnded <-chan struct{}       // the partition workers of the last generation are done
	for {
		if cg == nil {
			var err error
			topics, missingErr, err = s.awaitTopics(ctx, joined)
			if err != nil || ctx.Err() != nil {
				return err
			}
			groupCtx, groupCancel = groupContext(ctx) // cancelled by leave, or the deferred call
			cfg := s.groupConfig()
			cfg.Topics = topics
			cg, err = kafkago.NewConsumerGroup(cfg)
			if err != nil {
				return fmt.Errorf("%w: consumer group: %w", ErrConfig, err)
			}
			if missingErr != nil {
				s.log.Warn("some source topics are missing; reading the others until they exist",
					zap.Strings("topics", topics), zap.Error(missingErr))
				go s.watchTopics(groupCtx, groupCancel)
			}
		}
		// Next returns the next generation: it waits out the current one,
		// then joins.
		joinCtx, joinDone := context.WithCancel(groupCtx)
		go s.logSlowJoin(joinCtx, genEnded)
		gen, err := cg.Next(groupCtx)
		joinDone()
		if ctx.Err() != nil {
			return nil
		}
		if groupCtx.Err() != nil {
			s.log.Info("the missing source topics exist now; joining again with every topic")
			leave()
			continue
		}
		if err != nil {
			if member != "" && !errors.Is(err, kafkago.RebalanceInProgress) {
				// kafka-go dropped the member id with this error after
				// trying to leave, which fails when the broker cannot be
				// reached, and joins next as a new member. Not after
				// RebalanceInProgress: kafka-go then keeps the id it has,
				// which after a SyncGroup refused that way is this same
				// member, rejoined (a rejoin keeps its id), and live.
				m := member
				stale.Go(func() { s.removeStaleMember(staleCtx, m, "a membership kafka-go gave up after a failed generation") })
				member = ""
			}
			err = classify(err)
			if !joined && (errors.Is(err, ErrAuth) || errors.Is(err, ErrTLS)) {
				// Refused before we ever got in (e.g. no ACL for the
				// group): a configuration error, not a broker outage.
				return fmt.Errorf("kafka: join group %q: %w", s.cfg.Group, err)
			}
			s.setHealth("group", fmt.Errorf("kafka: join group %q: %w", s.cfg.Group, err))
			for _, t := range s.topics {
				s.cfg.Metrics.SourceErrors.WithLabelValues(t).Inc()
			}
			if suppressed, ok := joinFails.AllowKey(time.Now(), logthrottle.Shape(err.Error())); ok {
				s.log.Warn("join group failed; retrying", zap.Error(err), zap.Int("held_back", suppressed))
			}
			continue
		}
		joinFails.Reset()
		joined = true
		member = gen.MemberID
		s.writeMemberFile(member)
		// A topic of this group deleted while we run: leave the group and
		// join again with those that exist, rather than spin through
		// empty generations with every topic unassigned.
		if cerr := s.Check(ctx); slices.ContainsFunc(missingTopics(cerr), func(t string) bool { return slices.Contains(topics, t) }) {
			s.log.Warn("a source topic is missing; leaving the group to join again without it", zap.Error(cerr))
			s.setHealth("group", cerr)
			leave()
			continue
		}
		s.setHealth("group", missingErr)
		s.log.Info("joined group", zap.Int32("generation", gen.ID),
			zap.String("member", gen.MemberID), zap.Any("assignments", assignmentsOf(gen)))
		s.wantCaughtUp(gen)
		// One committer per generation sends the partitions' offsets;
		// it commits the last of them once the partition workers are done.
		cm := s.newGenCommitter(gen.CommitOffsets, s.log.With(zap.Int32("generation", gen.ID)))
		var genWorkers sync.WaitGroup
		wctx := groupCtx // leaving the group stops the workers as a shutdown does: they commit what is stored
		for topic, parts := range gen.Assignments {
			for _, pa := range parts {
				workers.Add(1)
				genWorkers.Add(1)
				gen.Start(func(gctx context.Context) {
					defer workers.Done()
					defer genWorkers.Done()
					s.runPartition(wctx, gctx, gen, cm, h, topic, pa)
				})
			}
		}
		workersDone := make(chan struct{})
		go func() {
			genWorkers.Wait()
			close(workersDone)
		}()
		genEnded = workersDone
		workers.Add(1)
		gen.Start(func(gctx context.Context) {
			defer workers.Done()
			cm.run(wctx, gctx, workersDone)
		})
	}
}

// newGenCommitter returns the committer of a generation: commit is its
// CommitOffsets. Its failure and end lines are the source's (commitLines),
// so the end of failures logged in one generation is logged in the next.
func (s *Source) newGenCommitter(commit func(offsets) error, log *zap.Logger) *committer {
	c := newCommitter(commit, s.cfg.RetryMin, s.cfg.RetryMax, log,
		func(topic string) { s.cfg.Metrics.SourceErrors.WithLabelValues(topic).Inc() })
	c.lines = &s.commitLines
	return c
}

// logSlowJoin logs once if a join of the group takes longer than
// joinWaitLog, counted from the end of the previous generation (ended: its
// partition workers are done; nil before the first join), until ctx ends
// (the join is over).
func (s *Source) logSlowJoin(ctx context.Context, ended <-chan struct{}) {
	if ended != nil {
		select {
		case <-ended:
		case <-ctx.Done():
			return
		}
	}
	t := time.NewTimer(s.joinWaitLog)
	defer t.Stop()
	select {
	case <-t.C:
		s.log.Info("waiting for the consumer group to assign partitions: a member that stopped without leaving (kill -9, OOM) is waited for until its session times out",
			zap.Duration("waited", s.joinWaitLog), zap.Duration("session_timeout", s.cfg.SessionTimeout))
	case <-ctx.Done():
	}
}

// removeStaleMember removes member, a membership of this source that
// kafka-go gave up after a failed generation, from the group. kafka-go
// tried to leave it then, which fails while the broker cannot be reached
// (a network blip, a broker restart), and joins as a new member once it
// can; the coordinator then waits for the old member until its session
// or the rebalance timeout runs out, and nothing is taken in meanwhile:
// after every short outage, for up to the session timeout (30 s by
// default). Any client may send the LeaveGroup; member is never the id
// kafka-go joins with next (the coordinator gives each new member a new
// one). It retries until the group no longer lists the member (read with
// DescribeGroups), the coordinator refuses this bridge the group (the join
// is refused the same way), the session or rebalance timeout has passed
// (the coordinator has removed it by then) or ctx ends.
//
// The previous run's member, read from Config.MemberFile at the start, is
// removed the same way: a crashed process left it in the group, and the
// coordinator would hold the new join for its session.
func (s *Source) removeStaleMember(ctx context.Context, member, why string) {
	deadline := time.Now().Add(max(s.cfg.SessionTimeout, s.cfg.RebalanceTimeout))
	wait := s.cfg.RetryMin
	sent := false
	readBack := false // the last LeaveGroup was answered; the group is read back
	for ctx.Err() == nil && time.Now().Before(deadline) {
		// Whether the member is there is read from the group, before the
		// LeaveGroup and after it: kafka-go decodes a LeaveGroup response
		// of version 1 and later with its error code and throttle time
		// swapped, so the answer's own error is lost.
		present, err := s.groupHasMember(ctx, member)
		switch {
		case err == nil && !present:
			if sent {
				s.log.Info("removed this bridge's previous membership of the group, so that the join does not wait for its session to time out",
					zap.String("member", member), zap.String("which", why))
			}
			return
		case errors.Is(err, kafkago.GroupAuthorizationFailed):
			// The join is refused the same way, and says so.
			s.log.Debug("not allowed to remove the previous membership of the group", zap.String("member", member), zap.Error(err))
			return
		case err == nil && readBack:
			// Still there after a LeaveGroup the coordinator answered: it
			// refused it (NOT_COORDINATOR while the coordinator moves, say;
			// the error is lost, as above). Try again after the wait, not
			// back to back until the deadline.
			readBack = false
			err = errors.New("still in the group after a LeaveGroup")
		case err == nil:
			rctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
			var resp *kafkago.LeaveGroupResponse
			resp, err = s.client.LeaveGroup(rctx, &kafkago.LeaveGroupRequest{
				GroupID: s.cfg.Group, Members: []kafkago.LeaveGroupRequestMember{{ID: member}}})
			cancel()
			if err == nil {
				for _, m := range resp.Members {
					err = cmp.Or(err, m.Error)
				}
			}
			if err == nil {
				sent, readBack = true, true
				continue // read back at once
			}
		}
		s.log.Debug("removing the previous membership of the group", zap.String("member", member), zap.Error(err))
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		wait = min(2*wait, s.cfg.RetryMax)
	}
}

// groupHasMember says whether member is in the source's group.
func (s *Source) groupHasMember(ctx context.Context, member string) (bool, error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.DialTimeout)
	defer cancel()
	resp, err := s.client.DescribeGroups(rctx, &kafkago.DescribeGroupsRequest{GroupIDs: []string{s.cfg.Group}})
	if err != nil {
		return false, err
	}
	for _, g := range resp.Groups {
		if g.Error != nil {
			return false, g.Error
		}
		for _, m := range g.Members {
			if m.MemberID == member {
				return true, nil
			}
		}
	}
	return false, nil
}

// maxMemberID bounds the member id read back from Config.MemberFile.
const maxMemberID = 1024

// readMemberFile is the member id Config.MemberFile holds, "" when there
// is none or it cannot be read (then a crash's membership is waited for,
// as without the file).
func (s *Source) readMemberFile() string {
	if s.cfg.MemberFile == "" {
		return ""
	}
	b, err := os.ReadFile(s.cfg.MemberFile)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			s.log.Warn("reading the previous run's group member id", zap.Error(err))
		}
		return ""
	}
	id := strings.TrimSpace(string(b))
	if len(id) > maxMemberID || !utf8.ValidString(id) {
		s.log.Warn("ignoring a malformed group member id file", zap.String("file", s.cfg.MemberFile), zap.Int("bytes", len(b)))
		return ""
	}
	return id
}

// writeMemberFile records member in Config.MemberFile (a new file renamed
// over the old, not synced: losing it costs only the wait it saves).
func (s *Source) writeMemberFile(member string) {
	if s.cfg.MemberFile == "" {
		return
	}
	tmp := s.cfg.MemberFile + ".tmp"
	err := os.WriteFile(tmp, []byte(member+"\n"), 0o600)
	if err == nil {
		err = os.Rename(tmp, s.cfg.MemberFile)
	}
	if err != nil {
		s.log.Warn("recording the group member id (a restart after a crash will wait for the old member's session)", zap.Error(err))
	}
}

// leaveWait bounds how long a stopping source waits to leave its group.
var leaveWait = time.Second

// groupContext is the context of one consumer group's workers. It is
// context.WithCancel behind a call because its cancel is kept in a
// variable that leave (also deferred) calls, which vet's lostcancel check
// cannot follow.
func groupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithCancel(ctx)
}

// awaitTopics waits until at least one source topic exists (Health says
// why not) and returns those that do, with the error naming the missing
// ones (nil when none is). Before the first join it returns refused
// credentials and TLS failures; after it, it retries them like any other
// failure. It returns no topics when ctx ends.
func (s *Source) awaitTopics(ctx context.Context, joined bool) (present []string, missing error, err error) {
	for wait := s.cfg.RetryMin; ; wait = backoff(wait, s.cfg.RetryMax) {
		err := s.Check(ctx)
		if err == nil {
			s.setHealth("group", nil)
			s.notReady.Reset()
			return s.topics, nil, nil
		}
		if ctx.Err() != nil {
			return nil, nil, nil
		}
		if gone := missingTopics(err); len(gone) > 0 && len(gone) < len(s.topics) {
			s.setHealth("group", err)
			return slices.DeleteFunc(slices.Clone(s.topics), func(t string) bool { return slices.Contains(gone, t) }), err, nil
		}
		if !joined && (errors.Is(err, ErrAuth) || errors.Is(err, ErrTLS)) {
			return nil, nil, err
		}
		s.setHealth("group", err)
		if suppressed, ok := s.notReady.AllowKey(time.Now(), logthrottle.Shape(err.Error())); ok {
			s.log.Warn("kafka source not ready; retrying", zap.Duration("backoff", wait), zap.Error(err), zap.Int("held_back", suppressed))
		}
		if !sleep(ctx, wait) {
			return nil, nil, nil
		}
	}
}

// watchTopics checks, with backoff, whether every source topic exists,
// and calls done when they do (or returns when ctx ends).
func (s *Source) watchTopics(ctx context.Context, done context.CancelFunc) {
	for wait := s.cfg.RetryMin; sleep(ctx, wait); wait = backoff(wait, s.cfg.RetryMax) {
		if s.Check(ctx) == nil {
			done()
			return
		}
	}
}

func (s *Source) groupConfig() kafkago.ConsumerGroupConfig {
	return kafkago.ConsumerGroupConfig{
		ID:                    s.cfg.Group,
		Brokers:               s.cfg.Brokers,
		Dialer:                s.cfg.dialer(),
		Topics:                s.topics,
		HeartbeatInterval:     s.cfg.HeartbeatInterval,
		SessionTimeout:        s.cfg.SessionTimeout,
		RebalanceTimeout:      s.cfg.RebalanceTimeout,
		JoinGroupBackoff:      s.cfg.JoinBackoff,
		WatchPartitionChanges: true,
		StartOffset:           kafkago.FirstOffset,
		Timeout:               s.cfg.DialTimeout,
		Logger:                zapLogger(s.log, logDebug),
		ErrorLogger:           throttledLogger(s.log, logWarn),
	}
}

func assignmentsOf(gen *kafkago.Generation) map[string][]int {
	out := make(map[string][]int, len(gen.Assignments))
	for t, ps := range gen.Assignments {
		for _, p := range ps {
			out[t] = append(out[t], p.ID)
		}
		slices.Sort(out[t])
	}
	return out
}

// lagGauge reports the messages of a partition not yet taken in: the last
// known high watermark (from the fetcher) minus the next offset to store
// (from the handler loop).
type lagGauge struct {
	g      prometheus.Gauge
	hw     atomic.Int64
	stored atomic.Int64
	// atEnd, if set, is called the first time the stored offset reaches
	// the high watermark.
	atEnd   func()
	reached atomic.Bool
}

func (l *lagGauge) update() {
	if hw, st := l.hw.Load(), l.stored.Load(); hw >= 0 && st >= 0 {
		l.g.Set(float64(max(hw-st, 0)))
		if st >= hw && l.atEnd != nil && l.reached.CompareAndSwap(false, true) {
			l.atEnd()
		}
	}
}

// stallGauge reports what open transactions hold back in a partition the
// worker reads: the offsets between the last stable offset and the high
// watermark, and how long the last stable offset has not moved while there
// are any. read_committed reads nothing past the LSO, so a transaction left
// open (a producer that hung or died, a hanging transaction on the broker)
// stops the partition's delays from being taken in while the lag gauge,
// which counts up to the LSO, shows nothing.
type stallGauge struct {
	unstable, stalled prometheus.Gauge
	lso               int64     // the last stable offset the stall is timed at
	since             time.Time // when it was first seen; zero: no stall
}

func newStallGauge(m *metrics.Metrics, topic string, partition int) *stallGauge {
	p := strconv.Itoa(partition)
	return &stallGauge{
		unstable: m.SourceUnstable.WithLabelValues(topic, p),
		stalled:  m.SourceStableStalled.WithLabelValues(topic, p),
	}
}

// observe takes a fetch's last stable offset and the offsets beyond it.
func (g *stallGauge) observe(lso, unstable int64, now time.Time) {
	if unstable <= 0 {
		g.reset()
		return
	}
	g.unstable.Set(float64(unstable))
	if g.since.IsZero() || lso != g.lso {
		g.lso, g.since = lso, now
	}
	g.stalled.Set(now.Sub(g.since).Seconds())
}

// reset reports no stall: none seen, or the worker no longer reads the
// partition (another member times it from when it took the partition).
func (g *stallGauge) reset() {
	g.since = time.Time{}
	g.unstable.Set(0)
	g.stalled.Set(0)
}

// fetched is a batch ready for the handler, with the offset to commit after
// it was handled. A nil batch only moves the commit past offsets without
// records (transaction markers, compacted batches). rewind (with a nil
// batch) says the fetcher went back to next, the start of a log that
// replaced the one read so far: the group's offset must be set back to it
// before anything of that log is stored.
type fetched struct {
	batch  *bridge.Batch
	next   int64 // last offset + 1
	rewind bool
	mem    int64 // the batch's share of the fetch memory budget
}

// runPartition owns one partition for one generation. It returns when the
// generation ends or ctx is cancelled; in kafka-go, a returning Start
// function ends the generation, so it never returns for any other reason.
func (s *Source) runPartition(ctx, gctx context.Context, gen *kafkago.Generation, cm *committer, h bridge.Handler, topic string, pa kafkago.PartitionAssignment) {
	key, p := CheckpointKey(topic, pa.ID), part{topic, pa.ID}
	log := s.log.With(zap.String("topic", topic), zap.Int("partition", pa.ID), zap.Int32("generation", gen.ID))
	// Whatever this worker reported of the partition (a failing start
	// position, rewind or fetch) is not this member's to report once it
	// stops: the next owner may be another member.
	defer s.setHealth(key, nil)
	defer s.retries.ok(log, p, false)
	defer s.handleFails.ok(log, p, false)

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(gctx, cancel)
	defer stop()

	if !s.awaitDeadLetters(wctx, h, key, log) {
		return
	}
	st, ok := s.startOffset(wctx, h, topic, pa.ID, pa.Offset, log)
	if !ok {
		return
	}
	start := st.offset
	log.Debug("partition assigned", zap.Int64("committed", pa.Offset), zap.Int64("start", start))
	switch {
	case st.rewind:
		// Another log than the group's offset was committed for: set the
		// group back to its start before storing any of it, or a crash
		// after the first store commit would resume at max(that offset,
		// stored+1) and skip the new log up to the old offset.
		if !cm.rewind(wctx, gctx, topic, pa.ID, start) {
			return
		}
	case start > pa.Offset && start >= 0 && gctx.Err() == nil:
		// The store is ahead of the group (we died or lost the generation
		// between store commit and offset commit): catch the group up now,
		// or the next owner without this store would read it all again.
		cm.offer(topic, pa.ID, start)
	}

	for wait := s.cfg.RetryMin; start < 0; wait = backoff(wait, s.cfg.RetryMax) {
		// No commit and no checkpoint: resolve the group's start position
		// (the log start) to a real offset.
		resolved, err := listOffset(wctx, s.client, topic, pa.ID, start)
		if err == nil {
			start = resolved
			break
		}
		s.retries.failed(log, zapcore.WarnLevel, p, "resolve start offset failed; retrying", err)
		if !sleep(wctx, wait) {
			return
		}
	}
	lag := &lagGauge{g: s.cfg.Metrics.SourceLag.WithLabelValues(topic, strconv.Itoa(pa.ID)),
		atEnd: func() { s.reachedEnd(key) }}
	lag.hw.Store(-1)
	lag.stored.Store(start)
	out := make(chan fetched, 1)
	pm := &partMem{m: s.mem}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(out)
		s.fetchLoop(wctx, topic, pa.ID, start, st.known, st.incarnation, out, lag, pm, log)
	}()
	defer func() {
		cancel()
		wg.Wait()
		// What was fetched and not stored (queued, being handed over,
		// a batch whose store the end cut short) is dropped: its share
		// of the budget goes back, whichever way the worker ended.
		pm.releaseAll()
		s.setHealth(key, nil)
		// This member no longer reads the partition: its lag is the next
		// owner's to report (a sum over members stays right).
		lag.g.Set(0)
	}()

	for f := range out {
		if f.rewind {
			if !cm.rewind(wctx, gctx, topic, pa.ID, f.next) {
				return
			}
			lag.stored.Store(f.next)
			lag.update()
			continue
		}
		if f.batch != nil && !s.handle(wctx, h, f.batch, p, pm, log) {
			return // ctx or generation ended before the batch was stored
		}
		pm.stored(f.mem)
		lag.stored.Store(f.next)
		lag.update()
		// The batch is durable: its offset goes to the generation's
		// committer. Not after a rebalance ended the generation: the
		// partition may belong to another member by now, and the stored
		// checkpoint covers us if it comes back. On our own shutdown the
		// generation is still ours until the group is left.
		if gctx.Err() != nil && ctx.Err() == nil {
			return
		}
		cm.offer(topic, pa.ID, f.next)
		if gctx.Err() != nil || ctx.Err() != nil {
			return
		}
	}
}

// generationOver reports commit errors after which this member must rejoin.
func generationOver(err error) bool {
	for _, e := range []error{
		// Not NOT_COORDINATOR or COORDINATOR_NOT_AVAILABLE: the offsets
		// topic failing an append (under min.insync.replicas, a moving
		// leader) answers commits so while the generation stands and
		// heartbeats go on; a coordinator that really moved fails the
		// heartbeat on the same connection, which ends the generation.
		kafkago.RebalanceInProgress, kafkago.IllegalGeneration, kafkago.UnknownMemberId,
		kafkago.FencedInstanceID,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// start is where a partition worker begins reading.
type start struct {
	offset int64
	// rewind: the log is not the one the stored checkpoint (and the
	// group's offset) was taken from; offset is its start.
	rewind bool
	// known is the checkpoint verified against the log (Fingerprint 0:
	// none), which the fetcher checks again after a failed fetch.
	known shard.Checkpoint
	// incarnation numbers the logs the partition has had (see
	// codec.Message.Incarnation): the stored checkpoint's, one more when
	// the log is another one, 0 without a checkpoint.
	incarnation uint32
}

// startOffset is max(committed, stored checkpoint + 1), unless the stored
// checkpoint has a fingerprint and the partition's log does not hold that
// record at its offset: then the topic was deleted and created again (or
// the bridge points at another cluster), and the worker starts at the new
// log's start, ignoring the group's committed offset too, which belongs to
// the old log as well. Duplicates can be recovered, skipped records
// cannot. A checkpoint without fingerprint (stored by an older version)
// and one whose record retention deleted cannot be checked and start as
// before. Failures are retried: starting without the checkpoint could
// ingest twice. So is a record not readable yet (errNotReadable): until
// it can be compared, neither start is safe.
func (s *Source) startOffset(ctx context.Context, h bridge.Handler, topic string, partition int, committed int64, log *zap.Logger) (start, bool) {
	key := CheckpointKey(topic, partition)
	wait := s.cfg.RetryMin
	for {
		began := time.Now()
		st, err := s.decideStart(ctx, h, topic, partition, committed, log)
		if err == nil {
			return st, true
		}
		if ctx.Err() != nil {
			return start{}, false
		}
		if staleMetadata(err) {
			s.pools.once(s.transport, began) // reload the transport's metadata
		}
		s.retries.failed(log, zapcore.WarnLevel, part{topic, partition}, "start position failed; retrying", err)
		s.setHealth(key, fmt.Errorf("kafka: checkpoint %s: %w", key, err))
		if !sleep(ctx, wait) {
			return start{}, false
		}
		wait = backoff(wait, s.cfg.RetryMax)
	}
}

// errNotReadable: the stored checkpoint's record cannot be compared yet;
// startOffset retries.
var errNotReadable = errors.New("the checkpointed record is not readable yet")

func (s *Source) decideStart(ctx context.Context, h bridge.Handler, topic string, partition int, committed int64, log *zap.Logger) (start, error) {
	cp, ok, err := loadCheckpoint(h, CheckpointKey(topic, partition))
	if err != nil {
		return start{}, fmt.Errorf("read checkpoint: %w", err)
	}
	if !ok {
		if committed > 0 && s.cfg.FreshStore {
			s.logUnstored(topic, partition, committed, log)
		}
		st := start{offset: committed}
		if partition == 0 {
			// A NATS stream of this name read by the store: its tasks
			// share the ids' scope with this topic's (bridge.CrossIncarnation).
			inc, other, err := bridge.StreamCrossIncarnation(h, topic)
			if err != nil {
				return start{}, fmt.Errorf("read the incarnation of a NATS stream named like the topic: %w", err)
			}
			if other {
				st.incarnation = inc
				log.Warn("the store has read a NATS delay stream named like this topic: the tasks it left pending share the scope of their ids with this topic's, "+
					"so a message here replaces or cancels the stream's task of the same id if its broker time is later",
					zap.Uint32("incarnation", inc))
			}
		}
		return st, nil
	}
	// Another log is the next incarnation. It is decided again after a
	// restart until the new log's first batch stores its checkpoint, so
	// it does not grow while nothing of that log is stored.
	c, err := s.checkIdentity(ctx, topic, partition, cp)
	if err != nil {
		return start{}, fmt.Errorf("check the log against the checkpoint: %w", err)
	}
	switch c.verdict {
	case identityPending:
		return start{}, fmt.Errorf("%w at the stored offset %d: %s", errNotReadable, cp.Offset, c.reason)
	case identityOther:
		log.Warn("the partition holds another log than the stored checkpoint was taken from "+
			"(topic deleted and created again, or another cluster); reading it from its start, "+
			"ignoring the checkpoint and the group's committed offset",
			zap.String("reason", c.reason), zap.Int64("stored_offset", cp.Offset),
			zap.Int64("committed", committed), zap.Int64("log_start", c.first), zap.Int64("log_end", c.end))
		return start{offset: c.first, rewind: committed > c.first, incarnation: cp.Incarnation + 1}, nil
	case identitySame:
		log.Debug("checkpoint matches the log", zap.Int64("stored_offset", cp.Offset))
		return start{offset: max(committed, cp.Offset+1), known: cp, incarnation: cp.Incarnation}, nil
	default:
		if cp.Fingerprint != 0 {
			log.Info("checkpoint cannot be checked against the log", zap.String("reason", c.reason),
				zap.Int64("stored_offset", cp.Offset), zap.Int64("log_start", c.first), zap.Int64("log_end", c.end))
		}
		return start{offset: max(committed, cp.Offset+1), incarnation: cp.Incarnation}, nil
	}
}

// logUnstored says, once per partition and process, that the group has
// read the partition up to committed while the store, created by this
// start, holds no checkpoint of it: the store that took in offsets below
// committed is not this one, and the tasks pending in it are not here.
// The usual causes are a changed data_dir and a volume that was replaced
// or wiped; the bridge cannot tell them from an intended fresh start, so
// it reads on. Only for a fresh store: one that has read the partition
// may still hold no checkpoint of it, when all it read were transaction
// markers or aborted records, whose offsets are committed without one.
func (s *Source) logUnstored(topic string, partition int, committed int64, log *zap.Logger) {
	key := CheckpointKey(topic, partition)
	s.mu.Lock()
	logged := s.unstored[key]
	if s.unstored == nil {
		s.unstored = make(map[string]bool)
	}
	s.unstored[key] = true
	s.mu.Unlock()
	if logged {
		return
	}
	log.Error("the consumer group has read this partition, but the store holds no checkpoint of it: "+
		"the tasks a previous store took in from offsets below the committed one are not in this store "+
		"(was data_dir changed, or its volume replaced or wiped?); reading on from the committed offset",
		zap.Int64("committed", committed))
}

// handle calls Handle with partition p's batch b until it succeeds; false
// means ctx ended first.
//
// While the batch waits for its dead letters longer than
// deadLetterStallAfter (a dead-letter topic that cannot be written holds
// it there: CONTRACT §3; Batch.DeadLetterWait), or is retried after
// another error, the partition's fetched records are moved out of the
// fetch memory budget (partMem.stall), so that partitions held this way
// do not stop the others, and counted again once it is stored. A store
// that refuses writes refuses every partition's: their records stay
// counted, and memory within the budget.
func (s *Source) handle(ctx context.Context, h bridge.Handler, b *bridge.Batch, p part, pm *partMem, log *zap.Logger) bool {
	wait := s.cfg.RetryMin
	// A DLQ that cannot be written holds Handle in its wait for the
	// batch's dead letters, with no error to retry on. Every batch with a
	// dead letter waits there, mostly for moments: only a wait that lasts
	// stalls the partition, or a backlog of dead letters (every record
	// of a misconfigured producer) would take each partition's records
	// out of the budget while others fill it, and count them again past
	// it once stored (review R220: several budgets held).
	var dlTimer *time.Timer
	var dlStalled chan struct{}
	b.DeadLetterWait = func() {
		if dlTimer != nil {
			return
		}
		done := make(chan struct{})
		dlStalled = done
		dlTimer = time.AfterFunc(deadLetterStallAfter, func() {
			defer close(done)
			pm.stall(false)
		})
	}
	// dlEnd ends the attempt's DLQ wait: no stall after it.
	dlEnd := func() {
		if dlTimer != nil && !dlTimer.Stop() {
			<-dlStalled // the stall ran or runs: let it finish first
		}
		dlTimer = nil
	}
	for {
		err := h.Handle(ctx, b)
		dlEnd()
		if err == nil {
			pm.unstall()
			s.handleFails.ok(log, p, true)
			return true
		}
		if ctx.Err() != nil {
			return false
		}
		pm.stall(storeWide(err))
		cp := b.Checkpoints[0]
		s.cfg.Metrics.SourceErrors.WithLabelValues(b.Items[0].Msg.Source).Inc()
		s.handleFails.failed(log, zapcore.WarnLevel, p, "handle failed; retrying the same batch", err,
			zap.Int("messages", len(b.Items)), zap.Int64("last_offset", cp.Offset), zap.Duration("backoff", wait))
		if !sleep(ctx, wait) {
			return false
		}
		wait = backoff(wait, s.cfg.RetryMax)
	}
}

// deadLetterStallAfter is how long a batch waits for its dead letters
// before its partition's fetched records leave the fetch memory budget
// (see Source.handle). A DLQ that works acknowledges within a produce's
// round trip.
var deadLetterStallAfter = time.Second

// storeWide reports whether err is the store refusing writes, which it
// does for every partition alike (see Source.handle).
func storeWide(err error) bool {
	return errors.Is(err, shard.ErrStoreFailed) || errors.Is(err, shard.ErrStoreLowSpace) ||
		errors.Is(err, shard.ErrStoreStalled) || errors.Is(err, shard.ErrClosed)
}

// fetchLoop reads the partition from offset and sends batches of at most
// MaxBatch messages to out until ctx ends. It runs one batch ahead of the
// handler, so fetching overlaps the store commit. When it has caught up
// with the log it lingers once for more records, so trickling traffic still
// makes batches (one fsync each) instead of one message per batch.
//
// Each batch's checkpoint carries the fingerprint of its last record. known
// is the last record read (the verified stored checkpoint at first): after
// a fetch reported the topic unknown (deleted), the fetcher checks that
// the log it comes back to still holds that record before it reads on.
//
// inc is the incarnation of the log at offset; each log that replaces it
// (rewindTo) is the next one. Messages and checkpoints carry it, so the
// store orders a new log's messages against the old one's by broker time,
// not by their offsets, which start again from 0.
func (s *Source) fetchLoop(ctx context.Context, topic string, partition int, offset int64, known shard.Checkpoint,
	inc uint32, out chan<- fetched, lag *lagGauge, pm *partMem, log *zap.Logger) {
	key, p := CheckpointKey(topic, partition), part{topic, partition}
	rules := s.rules[topic]
	wait := s.cfg.RetryMin
	var pending []bridge.Item
	var notes decodeNotes
	stall := newStallGauge(s.cfg.Metrics, topic, partition)
	defer stall.reset()
	size := newFetchSizer(s.cfg.FetchMaxBytes)
	msize := newMemSizer(s.cfg.FetchMaxBytes)
	// reserved is the budget this worker reserved for a fetch it has not
	// settled yet (a linger fetch's is taken before it loops back):
	// given back when the loop ends in between.
	var reserved int64
	defer func() { s.mem.release(reserved) }()
	// polled is the long poll outside the budget (fetchMem.poll) of the
	// fetch in flight, in place of reserved.
	var polled int64
	defer func() { s.mem.settlePoll(polled, 0) }()
	warnedLAT, warnedNoTS := false, false
	sent := offset   // the offset after the last batch handed over
	recheck := false // a fetch failed: check the log before reading on
	// rewindTo restarts at to, the start of a log that replaced the one
	// read so far, and has the handler set the group's offset back to it.
	rewindTo := func(to int64) bool {
		select {
		case out <- fetched{next: to, rewind: true}:
			offset, sent = to, to
			notes.untimed = nil
			known = shard.Checkpoint{}
			inc++
			stall.reset() // another log: its LSO says nothing of the old one's
			return true
		case <-ctx.Done():
			return false
		}
	}
	for ctx.Err() == nil {
		if recheck && len(pending) == 0 {
			if known.Fingerprint != 0 {
				c, err := s.checkIdentity(ctx, topic, partition, known)
				if err != nil {
					if ctx.Err() != nil {
						return
					}
					s.setHealth(key, fmt.Errorf("kafka: check %s/%d against the last record read: %w", topic, partition, classify(err)))
					s.retries.failed(log, zapcore.WarnLevel, p, "checking the log against the last record read failed; retrying", err,
						zap.Int64("offset", known.Offset), zap.Duration("backoff", wait))
					if !sleep(ctx, wait) {
						return
					}
					wait = backoff(wait, s.cfg.RetryMax)
					continue
				}
				switch c.verdict {
				case identityPending:
					// Neither reading on (a new log's records up to the
					// offset would be skipped) nor reading the log again
					// (a leader whose high watermark trails, or an open
					// transaction, is the same log) is safe before the
					// record can be compared: wait and check again.
					s.setHealth(key, fmt.Errorf("kafka: %s/%d: waiting for the record at offset %d, the last one read, to be readable again", topic, partition, known.Offset))
					s.retries.failed(log, zapcore.InfoLevel, p, "the record last read is not readable yet; checking again before reading on", nil,
						zap.String("reason", c.reason), zap.Int64("last_read", known.Offset),
						zap.Int64("log_start", c.first), zap.Int64("log_end", c.end), zap.Duration("backoff", wait))
					if !sleep(ctx, wait) {
						return
					}
					wait = backoff(wait, s.cfg.RetryMax)
					continue
				case identityOther:
					log.Warn("the partition now holds another log than the one read so far (the topic deleted and created again, or the log truncated); reading it from its start",
						zap.String("reason", c.reason), zap.Int64("last_read", known.Offset),
						zap.Int64("log_start", c.first), zap.Int64("log_end", c.end))
					if !rewindTo(c.first) {
						return
					}
				}
			}
			recheck = false
		}
		lingered := len(pending) > 0
		maxWait := s.cfg.MaxWait
		if lingered {
			maxWait = s.cfg.Linger
		}
		var hw int64
		var err error
		if reserved == 0 {
			// The worker waits its turn for a full fetch, or for less
			// when it had caught up (a long poll on an idle partition),
			// unless the budget is less than half used: idle partitions
			// never hold more than half of it for their long polls. One
			// lingering (records in hand) reserved before it looped back,
			// or it would hold them while waiting for others.
			// A partition idle since (its last fetch held little) polls
			// outside the budget, for idleFetchMemory at most: its
			// long poll never holds busy partitions back.
			if msize.caughtUp {
				reserved = s.mem.tryReserveWithin(msize.full(), s.mem.limit/2)
				if want := msize.want(); reserved == 0 && want <= idleFetchMemory {
					polled = s.mem.poll(want)
				}
			}
			if reserved == 0 && polled == 0 {
				if reserved, err = s.mem.reserve(ctx, msize.want()); err != nil {
					return
				}
			}
		}
		before, limit := len(pending), msize.limitFor(max(reserved, polled), size.limit(), size.stepping())
		began := time.Now()
		pending, offset, hw, err = s.fetch(ctx, topic, partition, offset, maxWait, limit, rules, pending, &notes)
		decoded := decodedBytes(pending[before:])
		mem := int64(decoded) + int64(len(pending)-before)*itemMemory // itemsMemory
		if polled > 0 {
			s.mem.settlePoll(polled, mem)
		} else {
			s.mem.settle(reserved, mem)
		}
		reserved, polled = 0, 0
		pm.fetched(mem)
		caughtUp := err == nil && hw >= 0 && offset >= hw
		msize.observe(mem, decoded, caughtUp)
		// A step that reached the end of the log left no batch out.
		size.nextAt(limit, decoded, notes.stepped && len(pending) == before && !caughtUp, caughtUp)
		if s.testHookFetched != nil {
			s.testHookFetched(limit, decoded)
		}
		if notes.logAppendTime && !warnedLAT {
			warnedLAT = true
			log.Warn("topic uses message.timestamp.type=LogAppendTime: delay-after is measured from the producer's record timestamp (CreateTime), which the client library reports; use CreateTime on delay topics")
		}
		if notes.noTimestamp > 0 && !warnedNoTS {
			warnedNoTS = true
			log.Warn("records without a timestamp (old message format): delay-after is measured from when the bridge read them",
				zap.Int("records", notes.noTimestamp))
		}
		switch {
		case ctx.Err() != nil:
			return
		case err != nil && errors.Is(err, kafkago.OffsetOutOfRange) && len(pending) == 0:
			if reset, rewind, rerr := s.resetOffset(ctx, topic, partition, offset, log); rerr == nil {
				if rewind {
					if !rewindTo(reset) {
						return
					}
				} else {
					offset = reset
				}
				continue
			}
			fallthrough
		case err != nil:
			// Whatever failed (the topic reported unknown, a broker
			// unreachable, a leader moving), the topic may have been
			// deleted and created again meanwhile, and the new log may
			// already reach past offset: a fetch there would return the
			// new log's records from offset on and skip those before it.
			// So the next fetch waits for a check of the record last read
			// (a ListOffsets and a Fetch, once per failure streak).
			recheck = true
			if staleMetadata(err) {
				// kafka-go's transport refreshes its metadata cache only
				// every MetadataTTL, never on a leader change; dropping
				// its connection pools makes the next request reload it
				// (once for the partitions a leader move failed).
				s.pools.once(s.transport, began)
			}
			s.setHealth(key, fmt.Errorf("kafka: fetch %s/%d: %w", topic, partition, classify(err)))
			s.cfg.Metrics.SourceErrors.WithLabelValues(topic).Inc()
			s.retries.failed(log, zapcore.WarnLevel, p, "fetch failed; retrying", err,
				zap.Int64("offset", offset), zap.Duration("backoff", wait))
			if len(pending) > 0 {
				break // hand over what we have, then retry
			}
			if !sleep(ctx, wait) {
				return
			}
			wait = backoff(wait, s.cfg.RetryMax)
			continue
		default:
			wait = s.cfg.RetryMin
			s.setHealth(key, nil)
			s.retries.ok(log, p, true)
			if hw >= 0 {
				lag.hw.Store(hw)
				lag.update()
				stall.observe(hw, notes.unstable, s.now())
			}
		}
		if len(pending) == 0 {
			if err == nil && offset > sent {
				// Only transaction markers or compacted-away batches since
				// the last batch: commit past them once what came before
				// is handled, or the group would lag behind them forever.
				select {
				case out <- fetched{next: offset}:
					sent = offset
				case <-ctx.Done():
					return
				}
			}
			continue
		}
		if !lingered && caughtUp && s.cfg.Linger > 0 && len(pending) < s.cfg.MaxBatch {
			// Linger only with budget to spare now: waiting for it with
			// records in hand could hold them while every other worker
			// does the same.
			if reserved = s.mem.tryReserve(msize.full()); reserved > 0 {
				continue
			}
		}
		for len(pending) > 0 {
			n := min(len(pending), s.cfg.MaxBatch)
			items := pending[:n:n]
			pending = pending[n:]
			if inc != 0 {
				for i := range items {
					items[i].Msg.Incarnation = inc
				}
			}
			lm := &items[n-1].Msg
			cp := shard.Checkpoint{Key: key, Offset: lm.Offset, Fingerprint: fingerprint(lm, notes.untimedAt(lm.Offset)), Incarnation: inc}
			f := fetched{
				batch: &bridge.Batch{Items: items, Checkpoints: []shard.Checkpoint{cp}},
				next:  cp.Offset + 1,
				mem:   itemsMemory(items),
			}
			if !s.sendRefreshingLag(ctx, out, f, topic, partition, lag) {
				return
			}
			sent, known = f.next, cp
		}
		pending = nil
	}
}

// lagRefresh is how often a fetch loop blocked on its handler (a batch
// held, e.g. by a DLQ that cannot be written) reads the partition's last
// stable offset, so delaybridge_source_lag_messages keeps counting what
// is published meanwhile instead of freezing at the last fetch.
var lagRefresh = time.Second

// sendRefreshingLag hands f to the handler loop; while that waits, it
// refreshes the lag gauge from ListOffsets (read_committed: the last stable
// offset, as fetches report it). False when ctx ended first.
func (s *Source) sendRefreshingLag(ctx context.Context, out chan<- fetched, f fetched, topic string, partition int, lag *lagGauge) bool {
	select {
	case out <- f:
		return true
	case <-ctx.Done():
		return false
	default:
	}
	t := time.NewTicker(lagRefresh)
	defer t.Stop()
	for {
		select {
		case out <- f:
			return true
		case <-ctx.Done():
			return false
		case <-t.C:
			if hw, err := listOffsetAs(ctx, s.client, topic, partition, kafkago.LastOffset, kafkago.ReadCommitted); err == nil && hw >= 0 {
				lag.hw.Store(hw)
				lag.update()
			}
		}
	}
}

// staleMetadata reports errors that mean the partition leader moved.
func staleMetadata(err error) bool {
	for _, e := range []error{
		kafkago.NotLeaderForPartition, kafkago.LeaderNotAvailable, kafkago.UnknownTopicOrPartition,
		kafkago.ReplicaNotAvailable, kafkago.FencedLeaderEpoch, kafkago.UnknownLeaderEpoch,
		kafkago.KafkaStorageError, kafkago.BrokerNotAvailable,
		// The transport's own metadata cache does not know the topic or
		// partition yet: partitions added, or the topic created again.
		protocol.ErrNoTopic, protocol.ErrNoPartition, protocol.ErrNoLeader,
	} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// fetch reads one fetch response into items. It returns the next offset to
// fetch and the high watermark (-1 when unknown).
func (s *Source) fetch(ctx context.Context, topic string, partition int, offset int64, maxWait time.Duration, maxBytes int,
	rules *codec.Rules, items []bridge.Item, notes *decodeNotes) ([]bridge.Item, int64, int64, error) {
	return fetchItems(ctx, s.client, &s.cfg, topic, partition, offset, maxWait, maxBytes, rules, items, notes)
}

// decodeNotes are facts about fetched batches that the caller may log.
type decodeNotes struct {
	// logAppendTime: a batch of a topic with message.timestamp.type
	// LogAppendTime. kafka-go drops the batch's append time, so its
	// records carry the producer's CreateTime.
	logAppendTime bool
	// noTimestamp: records without a timestamp (-1) took the fetch time.
	noTimestamp int
	// untimed holds the offsets of those records in ascending order, until
	// untimedAt passes them: their fingerprint hashes no time.
	untimed []int64
	// unstable: the offsets between the last stable offset and the high
	// watermark in the last response (records of open transactions, not
	// readable under read_committed yet). Fetch versions below 4 (brokers
	// before 0.11, which have no transactions) carry no LSO, and kafka-go
	// decodes it as 0 there; read_committed needs v4+ anyway.
	unstable int64
	// An identity check sets probe and probeAt to learn what occupies
	// the offset probeAt beside a readable record: a commit or abort
	// marker (atControl), or a record of an aborted transaction
	// (atAborted).
	probe                bool
	probeAt              int64
	atControl, atAborted bool
	// stepped: the position moved past the fetch offset because a batch
	// whose records all lie before it (compaction removed its last ones)
	// came first, not because a record was read (see fetchSizer.next).
	stepped bool
}

// untimedAt reports whether the record at offset had no timestamp and
// forgets the records up to offset.
func (n *decodeNotes) untimedAt(offset int64) bool {
	i := 0
	for i < len(n.untimed) && n.untimed[i] < offset {
		i++
	}
	hit := i < len(n.untimed) && n.untimed[i] == offset
	if hit {
		i++
	}
	n.untimed = n.untimed[i:]
	return hit
}

func fetchItems(ctx context.Context, client *kafkago.Client, cfg *Config, topic string, partition int, offset int64,
	maxWait time.Duration, maxBytes int, rules *codec.Rules, items []bridge.Item, notes *decodeNotes) ([]bridge.Item, int64, int64, error) {
	if notes != nil {
		// Facts of this fetch, also when it fails or is empty.
		notes.stepped = false
		notes.unstable = 0
	}
	if offset < 0 {
		// FirstOffset / LastOffset: resolve once, so the fetch position
		// (and the lag) is a real offset from here on.
		resolved, err := listOffset(ctx, client, topic, partition, offset)
		if err != nil {
			return items, offset, -1, err
		}
		offset = resolved
	}
	// Bound the round trip: kafka-go's transport has no read timeout of
	// its own, and a silent broker must not hang the partition.
	ctx, cancel := context.WithTimeout(ctx, 2*maxWait+cfg.DialTimeout)
	defer cancel()
	// The raw Fetch request rather than Client.Fetch: its response keeps
	// the aborted transactions, which Client.Fetch drops, and without them
	// a read_committed consumer would take in records of aborted
	// transactions.
	m, err := client.Transport.RoundTrip(ctx, client.Addr, &fetchAPI.Request{
		ReplicaID:      -1,
		MaxWaitTime:    int32(maxWait.Milliseconds()),
		MinBytes:       1,
		MaxBytes:       int32(maxBytes),
		IsolationLevel: int8(kafkago.ReadCommitted),
		SessionID:      -1,
		SessionEpoch:   -1,
		Topics: []fetchAPI.RequestTopic{{
			Topic: topic,
			Partitions: []fetchAPI.RequestPartition{{
				Partition:          int32(partition),
				CurrentLeaderEpoch: -1,
				FetchOffset:        offset,
				LogStartOffset:     -1,
				PartitionMaxBytes:  int32(maxBytes),
			}},
		}},
	})
	if err != nil {
		return items, offset, -1, err
	}
	res, ok := m.(*fetchAPI.Response)
	if !ok || len(res.Topics) == 0 || len(res.Topics[0].Partitions) == 0 {
		return items, offset, -1, fmt.Errorf("fetch %s/%d: empty response", topic, partition)
	}
	if res.ErrorCode != 0 {
		return items, offset, -1, kafkago.Error(res.ErrorCode)
	}
	p := &res.Topics[0].Partitions[0]
	if p.ErrorCode != 0 {
		return items, offset, -1, kafkago.Error(p.ErrorCode)
	}
	// read_committed cannot read past the last stable offset: it is the
	// end of the log for this worker while a transaction is open.
	hw := p.HighWatermark
	if p.LastStableOffset >= 0 && p.LastStableOffset < hw {
		hw = p.LastStableOffset
	}
	if notes != nil {
		notes.unstable = p.HighWatermark - hw
	}
	if p.RecordSet.Records == nil {
		return items, offset, hw, nil
	}
	aborted := slices.Clone(p.AbortedTransactions)
	slices.SortFunc(aborted, func(a, b fetchAPI.ResponseTransaction) int { return cmp.Compare(a.FirstOffset, b.FirstOffset) })
	items, next, err := decodeRecords(p.RecordSet.Records, topic, partition, offset, rules, aborted, items, time.Now(), notes)
	if err != nil {
		return items, next, -1, fmt.Errorf("decode fetch response: %w", err)
	}
	return items, next, hw, nil
}

// Control record types (the second int16 of a control record key).
const controlAbort = 0

// attrLogAppendTime is the timestamp-type bit of a v2 batch's attributes.
const attrLogAppendTime = 0x08

// decodeRecords appends the records at or after offset. It filters like a
// read_committed Java consumer: a transactional batch of a producer whose
// transaction the broker lists as aborted is dropped until that producer's
// abort marker. Control batches (commit/abort markers) are skipped but move
// the offset past them, or a partition ending in a marker would be fetched
// forever.
//
// A record without a timestamp (-1: an old message format) takes fetchedAt
// as its source time, so delay-after counts from when the bridge read it.
// notes may be nil.
func decodeRecords(rr kafkago.RecordReader, topic string, partition int, offset int64, rules *codec.Rules,
	aborted []fetchAPI.ResponseTransaction, items []bridge.Item, fetchedAt time.Time, notes *decodeNotes) ([]bridge.Item, int64, error) {
	if notes == nil {
		notes = new(decodeNotes)
	}
	notes.stepped = false // a fact of this fetch
	readers := []kafkago.RecordReader{rr}
	if st, ok := rr.(*protocol.RecordStream); ok {
		readers = st.Records
	}
	next, before := offset, len(items)
	abortedPIDs := map[int64]bool{}
	for _, r := range readers {
		var skip, control bool
		var pid int64
		base := int64(-1)
		switch b := r.(type) {
		case *protocol.RecordBatch:
			for len(aborted) > 0 && aborted[0].FirstOffset <= b.BaseOffset {
				abortedPIDs[aborted[0].ProducerID] = true
				aborted = aborted[1:]
			}
			skip = b.Attributes.Transactional() && abortedPIDs[b.ProducerID]
			base = b.BaseOffset
			if b.Attributes&attrLogAppendTime != 0 {
				notes.logAppendTime = true
			}
		case *protocol.ControlBatch:
			// A fetch may start at an abort marker, with the aborted
			// transaction it ends still listed: take the list up to here
			// first, as for a record batch, so the marker ends it rather
			// than leave it to mark the producer's next (committed)
			// transaction aborted.
			for len(aborted) > 0 && aborted[0].FirstOffset <= b.BaseOffset {
				abortedPIDs[aborted[0].ProducerID] = true
				aborted = aborted[1:]
			}
			control, pid, base = true, b.ProducerID, b.BaseOffset
		}
		last := int64(-1) // the highest record offset read from this batch
		for read := 0; ; read++ {
			rec, err := r.ReadRecord()
			if errors.Is(err, io.EOF) {
				if base >= 0 && last < offset {
					// A batch whose records all lie before the fetch
					// offset (compaction removed its last ones, keeping
					// its last offset for the producer state), or none at
					// all (compaction emptied it): the broker returned it,
					// so its range reaches the fetch offset, and nothing
					// is stored from its last record to there. kafka-go
					// drops the batch's last offset, so step past what it
					// surely covers rather than fetch it again forever:
					// the next batch may not fit beside it in the
					// response, and kafka-go drops a batch cut short.
					if step := max(base, offset) + 1; step > next {
						next, notes.stepped = step, true
					}
				}
				break
			}
			if err != nil {
				if len(items) > before {
					return items, next, nil // the rest is fetched again
				}
				return items, next, err
			}
			last = max(last, rec.Offset)
			if rec.Offset >= next {
				next = rec.Offset + 1
			}
			if notes.probe && rec.Offset == notes.probeAt {
				notes.atControl = notes.atControl || control
				notes.atAborted = notes.atAborted || (skip && !control)
			}
			if control {
				// An abort marker ends the producer's aborted transaction.
				if cr, err := protocol.ReadControlRecord(rec); err == nil && cr.Type == controlAbort {
					delete(abortedPIDs, pid)
				}
				continue
			}
			if rec.Offset < offset || skip {
				closeBytes(rec)
				continue
			}
			msg, err := toMessage(rec, topic, partition)
			if err != nil {
				return items, rec.Offset, err
			}
			if msg.Time.UnixMilli() < 0 {
				msg.Time = fetchedAt
				notes.noTimestamp++
				notes.untimed = append(notes.untimed, rec.Offset)
			}
			items = append(items, bridge.Item{Msg: msg, Rules: rules})
		}
	}
	return items, next, nil
}

// listOffset resolves kafkago.FirstOffset or LastOffset (the high
// watermark) of a partition.
func listOffset(ctx context.Context, client *kafkago.Client, topic string, partition int, which int64) (int64, error) {
	return listOffsetAs(ctx, client, topic, partition, which, kafkago.ReadUncommitted)
}

// listOffsetAs is listOffset as a consumer with that isolation level sees
// it: read_committed's LastOffset is the last stable offset.
func listOffsetAs(ctx context.Context, client *kafkago.Client, topic string, partition int, which int64, iso kafkago.IsolationLevel) (int64, error) {
	req := kafkago.FirstOffsetOf(partition)
	if which == kafkago.LastOffset {
		req = kafkago.LastOffsetOf(partition)
	}
	resp, err := client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{topic: {req}}, IsolationLevel: iso})
	if err != nil {
		return which, fmt.Errorf("list offsets %s/%d: %w", topic, partition, err)
	}
	for _, p := range resp.Topics[topic] {
		if p.Partition != partition {
			continue
		}
		if p.Error != nil {
			return which, fmt.Errorf("list offsets %s/%d: %w", topic, partition, p.Error)
		}
		if which == kafkago.LastOffset {
			return p.LastOffset, nil
		}
		return p.FirstOffset, nil
	}
	return which, fmt.Errorf("list offsets %s/%d: partition missing from the answer", topic, partition)
}

func closeBytes(rec *kafkago.Record) {
	if rec.Key != nil {
		_ = rec.Key.Close()
	}
	if rec.Value != nil {
		_ = rec.Value.Close()
	}
}

// toMessage converts a fetched record. A null value (length -1 on the wire)
// arrives as a nil Bytes and becomes a tombstone; an empty value stays an
// empty, non-nil slice.
func toMessage(rec *kafkago.Record, topic string, partition int) (codec.Message, error) {
	defer closeBytes(rec)
	key, err := kafkago.ReadAll(rec.Key)
	if err != nil {
		return codec.Message{}, fmt.Errorf("read key at offset %d: %w", rec.Offset, err)
	}
	value, err := kafkago.ReadAll(rec.Value)
	if err != nil {
		return codec.Message{}, fmt.Errorf("read value at offset %d: %w", rec.Offset, err)
	}
	var headers []codec.Header
	if len(rec.Headers) > 0 {
		headers = make([]codec.Header, len(rec.Headers))
		for i, hd := range rec.Headers {
			headers[i] = codec.Header{Key: hd.Key, Value: hd.Value}
		}
	}
	return codec.Message{
		Transport: codec.TransportKafka,
		Source:    topic,
		Partition: int32(partition),
		Offset:    rec.Offset,
		Key:       key,
		Value:     value,
		Tombstone: rec.Value == nil,
		Headers:   headers,
		Time:      rec.Time,
	}, nil
}

// resetOffset moves an out-of-range fetch offset into the log. Below the
// log start, retention deleted records before they were read: reset to the
// start (they are lost; logged at Error). Past the log end: reset to the
// start too, never to the end, and rewind the group's offset (rewind true).
// The fetcher moves only past records it read, so an offset past the end
// of the log it has been reading cannot happen: the log was replaced (the
// topic deleted and created again, another cluster) or truncated (an
// unclean leader election). Either way the records now in the log up to
// its end may be ones never read, and only its start skips none of them;
// the end would skip them all. Whether the identity of the log was known
// does not change that: a known, same log past its end is a truncated one,
// whose records after the truncation point are new. The cost is reading
// again what was read before, which the consumer's dedup absorbs.
func (s *Source) resetOffset(ctx context.Context, topic string, partition int, offset int64, log *zap.Logger) (reset int64, rewind bool, err error) {
	first, end, err := s.logRange(ctx, topic, partition)
	if err != nil {
		return offset, false, err
	}
	switch {
	case offset < first:
		log.Error("fetch offset below the log start: retention deleted records before they were read; resetting to the log start",
			zap.Int64("offset", offset), zap.Int64("log_start", first), zap.Int64("log_end", end))
		return first, false, nil
	case offset > end:
		log.Warn("fetch offset past the log end: the log was replaced (topic deleted and created again, "+
			"another cluster) or truncated; reading it from its start",
			zap.Int64("offset", offset), zap.Int64("log_start", first), zap.Int64("log_end", end))
		return first, true, nil
	default:
		return offset, false, fmt.Errorf("offset %d not out of range [%d, %d]", offset, first, end)
	}
}
