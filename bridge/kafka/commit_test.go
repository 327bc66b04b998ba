package kafka

import (
	"context"
	"errors"
	"maps"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// commitLog is a commit func that records what it was asked to commit and
// answers with the queued errors in turn (nil once they run out).
type commitLog struct {
	mu     sync.Mutex
	got    []offsets
	errs   []error
	failed int
}

func (l *commitLog) commit(p offsets) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	cp := offsets{}
	for t, ps := range p {
		cp[t] = maps.Clone(ps)
	}
	l.got = append(l.got, cp)
	if len(l.errs) == 0 {
		return nil
	}
	err := l.errs[0]
	l.errs = l.errs[1:]
	return err
}

func (l *commitLog) commits() []offsets {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]offsets(nil), l.got...)
}

func newTestCommitter(l *commitLog) *committer {
	return newCommitter(l.commit, 100*time.Millisecond, 5*time.Second, zap.NewNop(), func(string) {
		l.mu.Lock()
		l.failed++
		l.mu.Unlock()
	})
}

func equalOffsets(a, b offsets) bool {
	return maps.EqualFunc(a, b, func(x, y map[int]int64) bool { return maps.Equal(x, y) })
}

func TestCommitterFlush(t *testing.T) {
	transient := errors.New("connection reset")
	type offer struct {
		topic     string
		partition int
		next      int64
	}
	tests := []struct {
		name     string
		offers   []offer
		errs     []error
		later    []offer // offered after the first flush
		wantOK   []bool  // flush results, first then second
		want     []offsets
		wantFail int
	}{
		{
			name:   "coalesces partitions and topics into one request",
			offers: []offer{{"a", 0, 5}, {"a", 1, 7}, {"b", 0, 2}},
			wantOK: []bool{true},
			want:   []offsets{{"a": {0: 5, 1: 7}, "b": {0: 2}}},
		},
		{
			name:   "an older offer never moves an offset back",
			offers: []offer{{"a", 0, 9}, {"a", 0, 4}},
			wantOK: []bool{true},
			want:   []offsets{{"a": {0: 9}}},
		},
		{
			name:     "a failed commit is retried with what is newest",
			offers:   []offer{{"a", 0, 5}, {"a", 1, 3}},
			errs:     []error{transient},
			later:    []offer{{"a", 0, 8}},
			wantOK:   []bool{true, true},
			want:     []offsets{{"a": {0: 5, 1: 3}}, {"a": {0: 8, 1: 3}}},
			wantFail: 1,
		},
		{
			name:     "generation over stops and drops",
			offers:   []offer{{"a", 0, 5}},
			errs:     []error{kafkago.IllegalGeneration},
			wantOK:   []bool{false},
			want:     []offsets{{"a": {0: 5}}},
			wantFail: 1,
		},
		{
			name:   "nothing queued sends nothing",
			wantOK: []bool{true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &commitLog{errs: tt.errs}
			c := newTestCommitter(l)
			for _, o := range tt.offers {
				c.offer(o.topic, o.partition, o.next)
			}
			if ok := c.flush(); ok != tt.wantOK[0] {
				t.Fatalf("first flush ok = %v", ok)
			}
			for _, o := range tt.later {
				c.offer(o.topic, o.partition, o.next)
			}
			if len(tt.wantOK) > 1 {
				if ok := c.flush(); ok != tt.wantOK[1] {
					t.Fatalf("second flush ok = %v", ok)
				}
			}
			got := l.commits()
			if len(got) != len(tt.want) {
				t.Fatalf("commits %v, want %v", got, tt.want)
			}
			for i := range got {
				if !equalOffsets(got[i], tt.want[i]) {
					t.Fatalf("commit %d = %v, want %v", i, got[i], tt.want[i])
				}
			}
			if l.failed != tt.wantFail {
				t.Fatalf("failed commits counted %d, want %d", l.failed, tt.wantFail)
			}
			if tt.wantOK[len(tt.wantOK)-1] && c.pendingLen() != 0 {
				t.Fatalf("offsets left queued after a good flush: %v", c.pending)
			}
		})
	}
}

func TestCommitterRun(t *testing.T) {
	t.Run("commits as offered and the last offsets at shutdown", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{}
			c := newTestCommitter(l)
			ctx, stop := context.WithCancel(context.Background())
			workersDone := make(chan struct{})
			done := make(chan struct{})
			go func() { c.run(ctx, context.Background(), workersDone); close(done) }()
			c.offer("a", 0, 5)
			synctest.Wait()
			stop()
			c.offer("a", 0, 6) // a worker's last batch, stored after the stop
			close(workersDone)
			<-done
			got := l.commits()
			if len(got) != 2 || !equalOffsets(got[0], offsets{"a": {0: 5}}) || !equalOffsets(got[1], offsets{"a": {0: 6}}) {
				t.Fatalf("commits %v, want a/0 at 5 then 6", got)
			}
		})
	})
	t.Run("a failed commit is retried after the pause", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{errs: []error{errors.New("timeout")}}
			c := newTestCommitter(l)
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			workersDone := make(chan struct{})
			close(workersDone)
			go c.run(ctx, context.Background(), workersDone)
			c.offer("a", 0, 5)
			synctest.Wait()
			if n := len(l.commits()); n != 1 {
				t.Fatalf("%d commits before the pause, want 1", n)
			}
			time.Sleep(100 * time.Millisecond)
			synctest.Wait()
			got := l.commits()
			if len(got) != 2 || !equalOffsets(got[1], offsets{"a": {0: 5}}) {
				t.Fatalf("commits %v, want the retry of a/0 at 5", got)
			}
			stop()
		})
	})
	t.Run("a rebalance drops what is queued", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{}
			c := newTestCommitter(l)
			gctx, endGen := context.WithCancel(context.Background())
			c.pending = offsets{"a": {0: 5}} // queued, not yet kicked
			endGen()
			c.run(context.Background(), gctx, nil)
			if got := l.commits(); len(got) != 0 {
				t.Fatalf("committed %v after the generation ended", got)
			}
		})
	})
	t.Run("a commit failing on is retried with a doubling pause and logged once", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var errs []error
			for range 8 {
				errs = append(errs, kafkago.GroupLoadInProgress)
			}
			l := &commitLog{errs: errs}
			core, logs := observer.New(zap.InfoLevel)
			c := newCommitter(l.commit, 100*time.Millisecond, 5*time.Second, zap.New(core), func(string) {})
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			workersDone := make(chan struct{})
			close(workersDone)
			go c.run(ctx, context.Background(), workersDone)
			c.offer("a", 0, 5)
			// Tries at 0, 0.1, 0.3, 0.7, 1.5 and 3.1 s: 6 by 3.2 s (a
			// fixed 100 ms pause made 33).
			time.Sleep(3200 * time.Millisecond)
			synctest.Wait()
			if n := len(l.commits()); n != 6 {
				t.Fatalf("%d commits in 3.2 s, want 6", n)
			}
			if n := logs.FilterMessageSnippet("offset commit failed").Len(); n != 1 {
				t.Fatalf("%d 'offset commit failed' lines for one failure repeating, want 1", n)
			}
			// Then 6.3 s and, the pause capped at 5 s, 11.3 s (both fail)
			// and 16.3 s, which succeeds and resets the pause.
			time.Sleep(13200 * time.Millisecond)
			synctest.Wait()
			if n := len(l.commits()); n != 9 {
				t.Fatalf("%d commits, want 9 (the last one good)", n)
			}
			if c.wait != c.retry || logs.FilterMessageSnippet("offset commit succeeded again").Len() != 1 {
				t.Fatalf("after a good commit: pause %v, want %v, and one line saying so", c.wait, c.retry)
			}
			stop()
		})
	})
	t.Run("recovery is logged with equal retry bounds too", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{errs: []error{kafkago.GroupLoadInProgress}}
			core, logs := observer.New(zap.InfoLevel)
			c := newCommitter(l.commit, time.Second, time.Second, zap.New(core), func(string) {})
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			workersDone := make(chan struct{})
			close(workersDone)
			go c.run(ctx, context.Background(), workersDone)
			c.offer("a", 0, 5)
			time.Sleep(1500 * time.Millisecond)
			synctest.Wait()
			if n := len(l.commits()); n != 2 {
				t.Fatalf("%d commits, want 2 (one failed, one good)", n)
			}
			if n := logs.FilterMessageSnippet("offset commit succeeded again").Len(); n != 1 {
				t.Fatalf("%d 'succeeded again' lines after a failure and a good commit with retry_min = retry_max, want 1", n)
			}
			stop()
		})
	})
	t.Run("coordinator unavailable is retried, not a generation's end", func(t *testing.T) {
		// The offsets topic under min.insync.replicas answers commits so
		// while the generation stands and heartbeats go on; a coordinator
		// that really moved fails the heartbeat, which ends the generation
		// (found by a Kafka fault hunt: the member left a working
		// generation and could not rejoin, and ingestion stopped).
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{errs: []error{kafkago.GroupCoordinatorNotAvailable, kafkago.NotCoordinatorForGroup}}
			c := newTestCommitter(l)
			ctx, stop := context.WithCancel(context.Background())
			defer stop()
			workersDone := make(chan struct{})
			close(workersDone)
			done := make(chan struct{})
			go func() { c.run(ctx, context.Background(), workersDone); close(done) }()
			c.offer("a", 0, 5)
			time.Sleep(time.Second)
			synctest.Wait()
			select {
			case <-done:
				t.Fatal("run ended: the commit error was taken for the end of the generation")
			default:
			}
			if got := l.commits(); len(got) != 3 || !equalOffsets(got[2], offsets{"a": {0: 5}}) {
				t.Fatalf("commits %v, want a/0 at 5 tried three times, the last good", got)
			}
			stop()
			<-done
		})
	})
	t.Run("generation over ends run", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{errs: []error{kafkago.RebalanceInProgress}}
			c := newTestCommitter(l)
			done := make(chan struct{})
			go func() { c.run(context.Background(), context.Background(), nil); close(done) }()
			c.offer("a", 0, 5)
			<-done
			if got := l.commits(); len(got) != 1 {
				t.Fatalf("commits %v, want the one that failed", got)
			}
		})
	})
}

// rewind sets a partition's offset back (a log that replaced the one the
// group's offset was committed for) and waits until that commit succeeded;
// no older offset queued or in flight may be committed after it.
func TestCommitterRewind(t *testing.T) {
	transient := errors.New("connection reset")
	// start runs rewind in the background; the channel gets its result.
	start := func(c *committer, gctx context.Context, next int64) chan bool {
		res := make(chan bool, 1)
		go func() { res <- c.rewind(context.Background(), gctx, "a", 0, next) }()
		synctest.Wait()
		return res
	}
	returned := func(res chan bool) (ok, done bool) {
		select {
		case ok = <-res:
			return ok, true
		default:
			return false, false
		}
	}
	t.Run("replaces a higher queued offset and waits for its commit", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{}
			c := newTestCommitter(l)
			c.offer("a", 0, 100)
			c.offer("a", 1, 7)
			res := start(c, context.Background(), 5)
			if _, done := returned(res); done {
				t.Fatal("rewind returned before its commit")
			}
			if !c.flush() {
				t.Fatal("flush failed")
			}
			synctest.Wait()
			if ok, done := returned(res); !ok || !done {
				t.Fatalf("rewind = %v (returned %v) after its commit, want true", ok, done)
			}
			if got := l.commits(); len(got) != 1 || !equalOffsets(got[0], offsets{"a": {0: 5, 1: 7}}) {
				t.Fatalf("commits %v, want a/0 at 5 with a/1 at 7", got)
			}
			c.offer("a", 0, 6) // the new log's first batch
			c.flush()
			if got := l.commits(); len(got) != 2 || !equalOffsets(got[1], offsets{"a": {0: 6}}) {
				t.Fatalf("commits %v, want a/0 at 6 after the rewind", got)
			}
		})
	})
	t.Run("an older commit failing in flight is not put back over it", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			release := make(chan error)
			var mu sync.Mutex
			var got []offsets
			c := newCommitter(func(p offsets) error {
				mu.Lock()
				cp := offsets{}
				for tp, ps := range p {
					cp[tp] = maps.Clone(ps)
				}
				got = append(got, cp)
				first := len(got) == 1
				mu.Unlock()
				if first {
					return <-release
				}
				return nil
			}, 100*time.Millisecond, 5*time.Second, zap.NewNop(), func(string) {})
			c.offer("a", 0, 100)
			c.offer("a", 1, 7)
			go c.flush() // in flight with a/0 at 100
			synctest.Wait()
			res := start(c, context.Background(), 5)
			release <- transient
			synctest.Wait()
			if _, done := returned(res); done {
				t.Fatal("rewind returned after a failed commit that did not carry it")
			}
			c.flush()
			synctest.Wait()
			if ok, done := returned(res); !ok || !done {
				t.Fatalf("rewind = %v (returned %v), want true", ok, done)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(got) != 2 || !equalOffsets(got[0], offsets{"a": {0: 100, 1: 7}}) || !equalOffsets(got[1], offsets{"a": {0: 5, 1: 7}}) {
				t.Fatalf("commits %v, want a/0 at 100 (failed), then at 5 with a/1 put back", got)
			}
		})
	})
	t.Run("its own failed commit is retried", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			l := &commitLog{errs: []error{transient}}
			c := newTestCommitter(l)
			res := start(c, context.Background(), 5)
			c.flush()
			synctest.Wait()
			if _, done := returned(res); done {
				t.Fatal("rewind returned after its commit failed")
			}
			c.flush()
			synctest.Wait()
			if ok, done := returned(res); !ok || !done {
				t.Fatalf("rewind = %v (returned %v), want true", ok, done)
			}
			if got := l.commits(); len(got) != 2 || !equalOffsets(got[1], offsets{"a": {0: 5}}) {
				t.Fatalf("commits %v, want a/0 at 5 twice", got)
			}
		})
	})
	t.Run("ends with the generation", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			c := newTestCommitter(&commitLog{})
			gctx, endGen := context.WithCancel(context.Background())
			res := start(c, gctx, 5)
			endGen()
			synctest.Wait()
			if ok, done := returned(res); ok || !done {
				t.Fatalf("rewind = %v (returned %v) after the generation ended, want false", ok, done)
			}
			c.mu.Lock()
			defer c.mu.Unlock()
			if len(c.rewinds) != 0 {
				t.Fatalf("%d rewinds left waiting", len(c.rewinds))
			}
		})
	})
}
