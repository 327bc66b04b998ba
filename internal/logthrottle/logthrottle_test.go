package logthrottle

import (
	"fmt"
	"testing"
	"time"
)

// TestThrottle: the first of a run is logged, then one per DefaultEvery
// with the count held back; Reset starts a new run.
func TestThrottle(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	var th Throttle
	for i, c := range []struct {
		at         time.Duration
		reset      bool
		ok         bool
		suppressed int
	}{
		{at: 0, ok: true},
		{at: time.Second},
		{at: 10 * time.Second},
		{at: DefaultEvery - time.Millisecond},
		{at: DefaultEvery, ok: true, suppressed: 3},
		{at: DefaultEvery + time.Second},
		{at: DefaultEvery + 2*time.Second, reset: true, ok: true},
		{at: DefaultEvery + 3*time.Second},
	} {
		if c.reset {
			th.Reset()
		}
		n, ok := th.Allow(t0.Add(c.at))
		if ok != c.ok || n != c.suppressed {
			t.Fatalf("step %d at %v: Allow = %d, %v; want %d, %v", i, c.at, n, ok, c.suppressed, c.ok)
		}
	}
}

// TestThrottleNewCause: a failure that differs from the one
// logged last is logged at once; only repeats of the same one are held
// back. With Allow alone, a join that first failed with "connection
// refused" and then with "GROUP_AUTHORIZATION_FAILED" (ACL removed while
// the cluster was down) showed only the first cause for up to DefaultEvery.
func TestThrottleNewCause(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	var th Throttle
	if _, ok := th.AllowKey(t0, "connection refused"); !ok {
		t.Fatal("first failure held back")
	}
	if _, ok := th.AllowKey(t0.Add(time.Second), "connection refused"); ok {
		t.Fatal("a repeat logged within DefaultEvery")
	}
	if n, ok := th.AllowKey(t0.Add(2*time.Second), "group authorization failed"); !ok || n != 1 {
		t.Fatalf("a new cause: Allow = %d, %v; want it logged at once with 1 held back", n, ok)
	}
	if _, ok := th.AllowKey(t0.Add(3*time.Second), "group authorization failed"); ok {
		t.Fatal("a repeat of the new cause logged within DefaultEvery")
	}
}

// TestThrottleManyKeys: past maxKeys recent keys, new keys share one
// overflow line per Every instead of wiping the others (which let every
// line through); keys idle for Every make room again.
func TestThrottleManyKeys(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC)
	var th Throttle
	lines := 0
	for round := range 3 { // three passes over 200 keys within one Every
		for i := range 200 {
			if _, ok := th.AllowKey(t0.Add(time.Duration(round)*time.Second), fmt.Sprint("k", i)); ok {
				lines++
			}
		}
	}
	if want := maxKeys + 1; lines != want {
		t.Fatalf("%d lines for 200 keys, three times within %v: want %d (each of the first %d keys once, the rest one overflow line)", lines, DefaultEvery, want, maxKeys)
	}
	// An Every later the old keys are forgotten: a new key has its own line.
	later := t0.Add(DefaultEvery + 3*time.Second)
	if _, ok := th.AllowKey(later, "new"); !ok {
		t.Fatal("a new key after the others went quiet was held back")
	}
	if _, ok := th.AllowKey(later, "new"); ok {
		t.Fatal("the same key twice at once was logged twice")
	}
}

// TestThrottleAllowEach: each key's held-back count is its own.
func TestThrottleAllowEach(t *testing.T) {
	t0 := time.Date(2026, 11, 27, 0, 0, 0, 0, time.UTC)
	var th Throttle
	for i, c := range []struct {
		at   time.Duration
		key  string
		ok   bool
		held int
	}{
		{0, "a", true, 0},
		{time.Second, "a", false, 0},
		{2 * time.Second, "a", false, 0},
		{3 * time.Second, "b", true, 0}, // a's two are not b's
		{4 * time.Second, "b", false, 0},
		{DefaultEvery, "a", true, 2},
		{DefaultEvery + 3*time.Second, "b", true, 1},
	} {
		held, ok := th.AllowEach(t0.Add(c.at), c.key)
		if ok != c.ok || held != c.held {
			t.Fatalf("step %d (%v, %s): ok=%v held=%d, want ok=%v held=%d", i, c.at, c.key, ok, held, c.ok, c.held)
		}
	}
}

// TestShape: runs of digits read as one '#', the rest is kept.
func TestShape(t *testing.T) {
	for in, want := range map[string]string{
		"": "",
		"fetch the checkpointed record at 99: [6] Not Leader": "fetch the checkpointed record at #: [#] Not Leader",
		"ingest batch of 1":   "ingest batch of #",
		"ingest batch of 137": "ingest batch of #",
		"127.0.0.1:9092":      "#.#.#.#:#",
		"7":                   "#",
		"no digits":           "no digits",
	} {
		if got := Shape(in); got != want {
			t.Errorf("Shape(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestThrottleDistinctKeysBounded (review R200): the throttles of H204 are
// keyed by texts from the network (an async error naming the subject
// refused, a subject no source reads, an error's shape naming a host).
// 100 000 distinct keys, at once and spread over 100 s, leave at most
// maxKeys entries and the overflow one, and let at most maxKeys+1 lines
// through per DefaultEvery; the held-back counts add up to every call.
func TestThrottleDistinctKeysBounded(t *testing.T) {
	const n = 100_000
	t0 := time.Date(2026, 11, 26, 0, 0, 0, 0, time.UTC)
	for _, step := range []time.Duration{0, time.Millisecond} {
		for _, mode := range []string{"key", "each", "forgotten"} {
			var th Throttle
			lines, held := map[int64]int{}, 0
			maxLen := 0
			for i := range n {
				now := t0.Add(time.Duration(i) * step)
				key := fmt.Sprintf("nats: Permissions Violation for Publish to \"orders.%x\"", i*7919)
				var s, f int
				var ok bool
				switch mode {
				case "key":
					s, ok = th.AllowKey(now, key)
				case "each":
					s, ok = th.AllowEach(now, key)
				default:
					s, f, ok = th.AllowEachForgotten(now, key)
				}
				if ok {
					lines[int64(now.Sub(t0)/DefaultEvery)]++
					held += s + f
				}
				th.mu.Lock()
				maxLen = max(maxLen, len(th.keys))
				th.mu.Unlock()
			}
			if maxLen > maxKeys+1 {
				t.Errorf("step %v %s: %d keys remembered, want at most %d", step, mode, maxLen, maxKeys+1)
			}
			total := 0
			for w, l := range lines {
				total += l
				if l > maxKeys+1 {
					t.Errorf("step %v %s: %d lines in interval %d, want at most %d", step, mode, l, w, maxKeys+1)
				}
			}
			// AllowKey counts what every key held back since the last
			// line; AllowEachForgotten per key, and the counts of keys
			// forgotten (not logged within the interval) in one sum
			// (review F211: AllowEach loses those, the overflow entry's
			// among them).
			if mode != "each" && total+held != n-lastHeld(&th) {
				t.Errorf("step %v %s: %d lines + %d held back reported, want %d calls (less %d still held)", step, mode, total, held, n, lastHeld(&th))
			}
			t.Logf("step %v %s: %d lines for %d distinct keys, at most %d keys remembered", step, mode, total, n, maxLen)
		}
	}
}

// lastHeld is what th holds back and has not reported yet: the count of
// AllowKey, or those of AllowEach's keys and of the keys it forgot.
func lastHeld(th *Throttle) int {
	th.mu.Lock()
	defer th.mu.Unlock()
	n := th.suppressed + th.forgotten
	for _, k := range th.keys {
		n += k.held
	}
	return n
}

// TestThrottleForgottenCount (review F211): maxKeys keys each held back
// once (64 subjects refused twice within DefaultEvery), then, an interval
// later, a new key: the old keys are forgotten to make room. Their 64
// held lines were lost: no line ever reported them, and a key that came
// back was logged with 0. AllowEachForgotten reports them with the next
// line, the new key's, beside its own count.
func TestThrottleForgottenCount(t *testing.T) {
	t0 := time.Date(2026, 11, 28, 0, 0, 0, 0, time.UTC)
	var th Throttle
	for i := range maxKeys {
		key := fmt.Sprint("k", i)
		th.AllowEachForgotten(t0, key)
		if _, _, ok := th.AllowEachForgotten(t0.Add(time.Second), key); ok {
			t.Fatalf("key %s: a repeat within %v logged", key, DefaultEvery)
		}
	}
	later := t0.Add(DefaultEvery + time.Second)
	held, forgotten, ok := th.AllowEachForgotten(later, "new")
	if !ok || held != 0 || forgotten != maxKeys {
		t.Fatalf("a new key past %d idle keys with a held line each: ok=%v held=%d forgotten=%d, want a line with 0 and %d", maxKeys, ok, held, forgotten, maxKeys)
	}
	// Reported once: k0 comes back as a new key, with its own count 0.
	held, forgotten, ok = th.AllowEachForgotten(later, "k0")
	if !ok || held != 0 || forgotten != 0 {
		t.Fatalf("a forgotten key back: ok=%v held=%d forgotten=%d, want a line with 0 and 0 (its count went with the line before)", ok, held, forgotten)
	}
}

// TestEpisode (review R210): a failure line is always followed by an end
// line (at once, whatever the interval); the ends of runs whose failure
// lines were all held back are one per Every, with the count held back.
func TestEpisode(t *testing.T) {
	t0 := time.Date(2026, 11, 28, 0, 0, 0, 0, time.UTC)
	var e Episode
	for i, c := range []struct {
		at     time.Duration
		logged bool // a failure line logged before this end
		ok     bool
		held   int
	}{
		{0, true, true, 0},
		{time.Second, false, false, 0},                 // a run held back: its end too
		{2 * time.Second, false, false, 0},             // again
		{3 * time.Second, true, true, 2},               // a failure line: its end at once
		{4 * time.Second, true, true, 0},               // and again, within Every
		{5 * time.Second, false, false, 0},             // held
		{DefaultEvery + 4*time.Second, false, true, 1}, // Every after the last end line
	} {
		if c.logged {
			e.Logged()
		}
		held, ok := e.End(t0.Add(c.at))
		if ok != c.ok || held != c.held {
			t.Fatalf("step %d (%v, logged %v): ok=%v held=%d, want ok=%v held=%d", i, c.at, c.logged, ok, held, c.ok, c.held)
		}
	}
}

// TestEpisodeOwed: the end lines held back are owed once their interval
// is over, as one end line standing for the last of them with the others
// held back (review R212: with no next end line they showed nowhere).
func TestEpisodeOwed(t *testing.T) {
	t0 := time.Date(2026, 11, 28, 0, 0, 0, 0, time.UTC)
	var e Episode
	e.Logged()
	if _, ok := e.End(t0); !ok {
		t.Fatal("the first end line held back")
	}
	for i, c := range []struct {
		at   time.Duration
		end  bool // an end (else a look at what is owed)
		ok   bool
		held int
	}{
		{time.Second, false, false, 0},                 // nothing held back
		{2 * time.Second, true, false, 0},              // a run held back: its end too
		{3 * time.Second, false, false, 0},             // owed only after Every
		{4 * time.Second, true, false, 0},              // another
		{DefaultEvery - time.Second, false, false, 0},  // not yet
		{DefaultEvery, false, true, 1},                 // the last of two, one before it
		{DefaultEvery + time.Second, false, false, 0},  // paid
		{DefaultEvery + 2*time.Second, true, false, 0}, // held again, within Every of the owed line
		{2*DefaultEvery + time.Second, false, true, 0}, // the one alone
	} {
		var held int
		var ok bool
		if c.end {
			held, ok = e.End(t0.Add(c.at))
		} else {
			held, ok = e.Owed(t0.Add(c.at))
		}
		if ok != c.ok || held != c.held {
			t.Fatalf("step %d (%v, end %v): ok=%v held=%d, want ok=%v held=%d", i, c.at, c.end, ok, held, c.ok, c.held)
		}
	}
}
