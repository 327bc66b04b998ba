package kafka

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/bridge"
)

// Two bridge instances (each with its own store) share the group while
// partitions move between them: join, leave. No message is lost, no
// instance stores a message twice, and the committed offset of a
// partition never passes a message that no instance has stored.
func TestSourceRebalanceTwoInstances(t *testing.T) {
	const parts = 4
	c := newCluster(t, kfake.SeedTopics(parts, "delay"))
	cl := producer(t, c)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	hA, hB := newMemHandler(), newMemHandler()

	// The invariant checker reads the commits first, then what is stored:
	// a commit is made only after its Handle returned, so a commit seen
	// here must be covered by the stores read after it.
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for ctx.Err() == nil {
			cm := committed(c, "g", "delay")
			stored := map[int32]map[int64]bool{}
			for _, h := range []*memHandler{hA, hB} {
				for p, offs := range h.offsets("delay") {
					if stored[p] == nil {
						stored[p] = map[int64]bool{}
					}
					for _, o := range offs {
						stored[p][o] = true
					}
				}
			}
			for p, off := range cm {
				for o := int64(0); o < off; o++ {
					if !stored[p][o] {
						t.Errorf("partition %d committed at %d but offset %d is in no store", p, off, o)
						return
					}
				}
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	defer func() { cancel(); wg.Wait() }()

	allCommitted := func(n int64) func() bool {
		return func() bool {
			cm := committed(c, "g", "delay")
			for p := range int32(parts) {
				if cm[p] != n {
					return false
				}
			}
			return true
		}
	}

	sA, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopA := runSource(t, sA, hA)
	produceN(t, cl, "delay", parts, 0, 100)
	waitFor(t, "A alone commits 25 per partition", allCommitted(25))

	sB, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopB := runSource(t, sB, hB)
	waitFor(t, "both members assigned", func() bool {
		gi := c.GroupInfo("g")
		if gi == nil || gi.State != "Stable" || len(gi.Members) != 2 {
			return false
		}
		return gi.Members[0].NumAssigned() > 0 && gi.Members[1].NumAssigned() > 0
	})
	produceN(t, cl, "delay", parts, 100, 100)
	waitFor(t, "A and B commit 50 per partition", allCommitted(50))
	if hB.count() == 0 {
		t.Fatal("B took no messages after the rebalance")
	}

	if err := stopA(); err != nil {
		t.Fatalf("A Run: %v", err)
	}
	produceN(t, cl, "delay", parts, 200, 100)
	waitFor(t, "B alone commits 75 per partition", allCommitted(75))
	if err := stopB(); err != nil {
		t.Fatalf("B Run: %v", err)
	}

	union := map[int32]map[int64]bool{}
	for name, h := range map[string]*memHandler{"A": hA, "B": hB} {
		for p, offs := range h.offsets("delay") {
			seen := map[int64]bool{}
			for _, o := range offs {
				if seen[o] {
					t.Errorf("%s stored partition %d offset %d twice", name, p, o)
				}
				seen[o] = true
				if union[p] == nil {
					union[p] = map[int64]bool{}
				}
				union[p][o] = true
			}
		}
	}
	for p := range int32(parts) {
		for o := range int64(75) {
			if !union[p][o] {
				t.Errorf("partition %d offset %d lost", p, o)
			}
		}
	}
	if gi := c.GroupInfo("g"); gi != nil && len(gi.Members) != 0 {
		t.Errorf("members left in the group after both stopped: %d", len(gi.Members))
	}
}

// A Handle that is still running when the generation ends stores its batch
// but must not commit it: the partition may already belong to the other
// instance, which reads the batch again from the committed offset.
func TestSourceNoCommitAfterGenerationEnds(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cl := producer(t, c)
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	hA, hB := newMemHandler(), newMemHandler()

	// Observe every OffsetCommit: generation and offset.
	type commit struct {
		gen    int32
		offset int64
	}
	var mu sync.Mutex
	var commits []commit
	c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.OffsetCommit}, Observe: true, Count: -1, When: func(r kmsg.Request) bool {
		req := r.(*kmsg.OffsetCommitRequest)
		mu.Lock()
		defer mu.Unlock()
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				commits = append(commits, commit{req.Generation, p.Offset})
			}
		}
		return true
	}})

	sA, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopA := runSource(t, sA, hA)
	produceN(t, cl, "delay", 1, 0, 5)
	waitFor(t, "A commits 5", func() bool { return committed(c, "g", "delay")[0] == 5 })
	gen1 := c.GroupInfo("g").Epoch

	// A's next Handle outlives the generation: it returns nil (stored)
	// only after the generation ended and its ctx was cancelled.
	var once sync.Once
	ended := make(chan struct{})
	hA.setFail(func(ctx context.Context, _ *bridge.Batch) error {
		first := false
		once.Do(func() { first = true })
		if first {
			<-ctx.Done()
			defer close(ended)
		}
		return nil
	})
	produceN(t, cl, "delay", 1, 5, 1) // offset 5
	waitFor(t, "A handling offset 5", func() bool {
		hA.mu.Lock()
		defer hA.mu.Unlock()
		return hA.attempts >= 2
	})

	sB, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	stopB := runSource(t, sB, hB)
	<-ended
	waitFor(t, "offset 5 stored and committed", func() bool {
		return committed(c, "g", "delay")[0] == 6 && (len(hA.offsets("delay")[0]) == 6 || len(hB.offsets("delay")[0]) == 1)
	})
	if err := stopA(); err != nil {
		t.Fatal(err)
	}
	if err := stopB(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, cm := range commits {
		if cm.gen == gen1 && cm.offset == 6 {
			t.Fatalf("offset 6 committed in generation %d after it ended (commits %v)", gen1, commits)
		}
	}
}
