package shard

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// listIDs is the ids of a page.
func listIDs(l TaskList) []string {
	ids := make([]string, len(l.Tasks))
	for i, t := range l.Tasks {
		ids[i] = t.ID
	}
	return ids
}

// inSource is t of source src.
func inSource(src string, t codec.Task) codec.Task {
	t.Source = src
	return t
}

// TestListTasks: ListTasks lists a source's pending tasks by id prefix, in
// byte order, after an id (excluded), at most a limit, with Next set when
// there may be more; ids with 0x00, 0xff and '/' bytes are ids like any
// other; cancel markers (a remembered cancel, a cancelled task) are left
// out; and source "src" does not list the tasks of "srcx" or "sr", whose
// names it prefixes or that prefixes it.
func TestListTasks(t *testing.T) {
	h := newHarness(t, nil)
	ids := []string{"a", "a/b", "a\x00", "a\x00b", "a\xff", "ab", "abc", "b", "\x00x", "\xff", "\xff\xff"}
	var tasks []codec.Task
	for i, id := range ids {
		tasks = append(tasks, sched(id, t0.Add(time.Duration(i+1)*time.Hour), int64(i+1)))
	}
	tasks = append(tasks,
		inSource("srcx", sched("a-other", t0.Add(time.Hour), 50)),
		inSource("sr", sched("ca", t0.Add(time.Hour), 51)), // key i sr 0x00 ca: not "src" + "a"
		sched("gone", t0.Add(time.Hour), 52),
	)
	h.ingest(tasks)
	// A remembered cancel (nothing pending) and a cancelled task: both
	// leave a cancel marker in the index.
	h.ingest([]codec.Task{cancelTask("aa", 60), cancelTask("gone", 61)})
	if err := h.e.Cancel("src", "abc"); err != nil {
		t.Fatal(err)
	}
	pending := slices.DeleteFunc(slices.Clone(ids), func(id string) bool { return id == "abc" })
	slices.Sort(pending) // byte order

	tests := []struct {
		name string
		q    ListQuery
		want []string
		next string
	}{
		{"all", ListQuery{}, pending, ""},
		{"prefix a", ListQuery{Prefix: "a"}, []string{"a", "a\x00", "a\x00b", "a/b", "ab", "a\xff"}, ""},
		{"prefix a NUL", ListQuery{Prefix: "a\x00"}, []string{"a\x00", "a\x00b"}, ""},
		{"prefix a slash", ListQuery{Prefix: "a/"}, []string{"a/b"}, ""},
		{"prefix 0xff", ListQuery{Prefix: "\xff"}, []string{"\xff", "\xff\xff"}, ""},
		{"prefix NUL", ListQuery{Prefix: "\x00"}, []string{"\x00x"}, ""},
		{"prefix of nothing", ListQuery{Prefix: "c"}, []string{}, ""},
		{"prefix of a marker only", ListQuery{Prefix: "aa"}, []string{}, ""},
		{"whole id as prefix", ListQuery{Prefix: "abc"}, []string{}, ""},
		{"after excludes", ListQuery{Prefix: "a", After: "a\x00b"}, []string{"a/b", "ab", "a\xff"}, ""},
		{"after not an id", ListQuery{Prefix: "a", After: "a0"}, []string{"ab", "a\xff"}, ""},
		{"after before prefix", ListQuery{Prefix: "b", After: "a"}, []string{"b"}, ""},
		{"after past prefix", ListQuery{Prefix: "a", After: "b"}, []string{}, ""},
		{"after 0xff", ListQuery{After: "\xff"}, []string{"\xff\xff"}, ""},
		{"after the last", ListQuery{After: "\xff\xff"}, []string{}, ""},
		{"limit", ListQuery{Prefix: "a", Limit: 2}, []string{"a", "a\x00"}, "a\x00"},
		{"limit and after", ListQuery{Prefix: "a", After: "a\x00b", Limit: 2}, []string{"a/b", "ab"}, "ab"},
		{"limit reaches the end", ListQuery{Prefix: "a", After: "a/b", Limit: 2}, []string{"ab", "a\xff"}, ""},
		// ab is followed by abc's cancel marker only: no more tasks.
		{"only a marker after the limit", ListQuery{Prefix: "ab", Limit: 1}, []string{"ab"}, ""},
		{"limit 1 with more", ListQuery{Prefix: "b", After: "a", Limit: 1}, []string{"b"}, ""},
		{"limit 1 at the start", ListQuery{Limit: 1}, []string{"\x00x"}, "\x00x"},
		{"limit exactly all", ListQuery{Prefix: "a\x00", Limit: 2}, []string{"a\x00", "a\x00b"}, ""},
		{"limit above max", ListQuery{Limit: MaxListLimit + 5}, pending, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l, err := h.e.ListTasks("src", tt.q)
			if err != nil {
				t.Fatal(err)
			}
			if got := listIDs(l); !slices.Equal(got, tt.want) || l.Next != tt.next {
				t.Fatalf("ListTasks(%+v) = %+q next %q, want %+q next %q", tt.q, got, l.Next, tt.want, tt.next)
			}
			if l.Tasks == nil {
				t.Fatal("Tasks is nil (JSON null)")
			}
			for _, ti := range l.Tasks {
				want, err := h.e.Lookup("src", ti.ID)
				if err != nil {
					t.Fatalf("Lookup(%q): %v", ti.ID, err)
				}
				if !ti.Due.Equal(want.Due.Time) || ti != want {
					t.Fatalf("listed %+v, Lookup %+v", ti, want)
				}
			}
		})
	}
	for _, src := range []string{"srcx", "sr"} {
		l, err := h.e.ListTasks(src, ListQuery{})
		if err != nil {
			t.Fatal(err)
		}
		want := map[string][]string{"srcx": {"a-other"}, "sr": {"ca"}}[src]
		if got := listIDs(l); !slices.Equal(got, want) {
			t.Errorf("ListTasks(%q) = %q, want %q", src, got, want)
		}
	}
	if l, err := h.e.ListTasks("s", ListQuery{}); err != nil || len(l.Tasks) != 0 {
		t.Errorf("ListTasks(\"s\") = %+v, %v; want none", l, err)
	}
}

// TestListTasksPages: following Next from page to page with any limit
// lists every pending task exactly once, in order.
func TestListTasksPages(t *testing.T) {
	h := newHarness(t, nil)
	var tasks []codec.Task
	var want []string
	for i := range 40 {
		id := fmt.Sprintf("t%02d", i)
		if i%5 == 0 {
			id += "/\xff\x00"
		}
		want = append(want, id)
		tasks = append(tasks, sched(id, t0.Add(time.Hour), int64(i+1)))
	}
	h.ingest(tasks)
	// Markers between the tasks.
	h.ingest([]codec.Task{cancelTask("t03x", 100), cancelTask("t17x", 101), cancelTask("u", 102)})
	slices.Sort(want)
	for _, limit := range []int{1, 3, 7, 40, 41} {
		var got []string
		q := ListQuery{Limit: limit}
		for pages := 0; ; pages++ {
			if pages > 50 {
				t.Fatalf("limit %d: more than 50 pages", limit)
			}
			l, err := h.e.ListTasks("src", q)
			if err != nil {
				t.Fatal(err)
			}
			if len(l.Tasks) > limit {
				t.Fatalf("limit %d: page of %d", limit, len(l.Tasks))
			}
			got = append(got, listIDs(l)...)
			if l.Next == "" {
				break
			}
			q.After = l.Next
		}
		if !slices.Equal(got, want) {
			t.Fatalf("limit %d: pages listed %q, want %q", limit, got, want)
		}
	}
}

// TestListTasksSkipBound: a page steps over at most maxListSkip entries
// it does not list (here remembered cancels) and then says where to go
// on, so a source with many markers costs each page a bounded read; the
// pages still list every task once.
func TestListTasksSkipBound(t *testing.T) {
	h := newHarness(t, nil)
	var cancels []codec.Task
	for i := range maxListSkip + 10 {
		cancels = append(cancels, cancelTask(fmt.Sprintf("m%06d", i), int64(i+1)))
	}
	h.ingest(cancels)
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1e6), sched("z", t0.Add(time.Hour), 1e6+1)})
	l, err := h.e.ListTasks("src", ListQuery{})
	if err != nil {
		t.Fatal(err)
	}
	lastSkipped := fmt.Sprintf("m%06d", maxListSkip-1)
	if got := listIDs(l); !slices.Equal(got, []string{"a"}) || l.Next != lastSkipped {
		t.Fatalf("first page %q next %q, want [a] next %q", got, l.Next, lastSkipped)
	}
	l, err = h.e.ListTasks("src", ListQuery{After: l.Next})
	if err != nil {
		t.Fatal(err)
	}
	if got := listIDs(l); !slices.Equal(got, []string{"z"}) || l.Next != "" {
		t.Fatalf("second page %q next %q, want [z] and no next", got, l.Next)
	}
}

// TestListTasksPointInTime: a task fired, or moved by a failed publish's
// retry, after ListTasks read its index entry and before it read its
// envelope is listed as it was when the page began (one state of the
// store), not left out and not an error; the next page no longer has the
// fired one, and has the retried one at its new fire time.
func TestListTasksPointInTime(t *testing.T) {
	h := newHarness(t, func(o *Options) { o.Retry = RetryPolicy{Initial: time.Minute, Max: time.Minute, Jitter: -1} })
	h.ingest([]codec.Task{sched("fire", t0.Add(time.Second), 1), sched("retry", t0.Add(time.Second), 2), sched("stay", t0.Add(time.Hour), 3)})
	h.sink.setFail(func(t *codec.Task) error {
		if t.ID == "retry" {
			return errors.New("broker says no")
		}
		return nil
	})
	var hooked []string
	t.Cleanup(func() { testHookListEntry = nil }) // before the engine runs
	testHookListEntry = func(id string) {
		hooked = append(hooked, id)
		if len(hooked) == 1 {
			h.advance(time.Second) // both fire: one is delivered, one moves to its retry
			if !slices.Contains(h.sink.acked(), "fire") {
				t.Fatalf("not delivered: %+v", h.sink.all())
			}
		}
	}
	h.run()
	before, err := h.e.ListTasks("src", ListQuery{})
	if err != nil {
		t.Fatal(err)
	}
	testHookListEntry = nil
	if got := listIDs(before); !slices.Equal(got, []string{"fire", "retry", "stay"}) {
		t.Fatalf("listed %q, want fire, retry, stay as they were when the page began", got)
	}
	if r := before.Tasks[1]; r.Attempts != 0 || !r.NextFire.Equal(t0.Add(time.Second)) {
		t.Fatalf("retry listed as %+v, want as before its publish", r)
	}
	after, err := h.e.ListTasks("src", ListQuery{})
	if err != nil {
		t.Fatal(err)
	}
	if got := listIDs(after); !slices.Equal(got, []string{"retry", "stay"}) {
		t.Fatalf("then listed %q, want retry, stay", got)
	}
	if r := after.Tasks[0]; r.Attempts != 1 || !r.NextFire.Equal(t0.Add(time.Second+time.Minute)) {
		t.Fatalf("retry then listed as %+v, want 1 attempt, next fire a minute after its due", r)
	}
}

// TestListTasksLeavesOutUnreadable: an index entry whose envelope is not
// in the store, and entries that do not decode (an index value, an
// envelope), are left out of the page, not an error that would stop
// every page from getting past them; the undecodable ones are logged
// once per call.
func TestListTasksLeavesOutUnreadable(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	h := newHarness(t, func(o *Options) { o.Logger = zap.New(core) })
	h.ingest([]codec.Task{sched("a", t0.Add(time.Hour), 1), sched("b", t0.Add(time.Hour), 2),
		sched("c", t0.Add(time.Hour), 3), sched("d", t0.Add(time.Hour), 4), sched("e", t0.Add(time.Hour), 5)})
	entry := func(id string) indexEntry {
		var ex indexEntry
		if found, err := getIndex(h.e.db, appendIndexKey(nil, "src", id), &ex); err != nil || !found {
			t.Fatalf("index of %s: %v %v", id, found, err)
		}
		return ex
	}
	// b: its envelope is gone. c: its index value is garbage. d: its
	// envelope is.
	b, d := entry("b"), entry("d")
	if err := h.e.db.Delete(appendTaskKey(nil, h.e.shardOf("src", "b"), b.Fire, b.Seq), nil); err != nil {
		t.Fatal(err)
	}
	if err := h.e.db.Set(appendIndexKey(nil, "src", "c"), []byte{9, 9, 9}, nil); err != nil {
		t.Fatal(err)
	}
	if err := h.e.db.Set(appendTaskKey(nil, h.e.shardOf("src", "d"), d.Fire, d.Seq), []byte("not an envelope"), nil); err != nil {
		t.Fatal(err)
	}
	l, err := h.e.ListTasks("src", ListQuery{})
	if err != nil {
		t.Fatal(err)
	}
	if got := listIDs(l); !slices.Equal(got, []string{"a", "e"}) || l.Next != "" {
		t.Fatalf("listed %q next %q, want [a e]", got, l.Next)
	}
	lines := logs.FilterMessage("list: left out entries that do not decode").All()
	if len(lines) != 1 || lines[0].ContextMap()["count"] != int64(2) || lines[0].ContextMap()["first_id"] != "c" {
		t.Fatalf("log lines %+v, want one with count 2, first_id c", lines)
	}
}

// TestListTasksRefuses: a closed engine answers ErrClosed; an empty source
// or one with a NUL byte (which would list another source's ids: "s\x00a"
// is the index prefix of source "s", ids "a...") is ErrBadListQuery.
func TestListTasksRefuses(t *testing.T) {
	h := newHarness(t, nil)
	h.ingest([]codec.Task{inSource("s", sched("a\x00b", t0.Add(time.Hour), 1))})
	for _, src := range []string{"", "s\x00a", "\x00"} {
		if l, err := h.e.ListTasks(src, ListQuery{}); !errors.Is(err, ErrBadListQuery) {
			t.Errorf("ListTasks(%q) = %+v, %v; want ErrBadListQuery", src, l, err)
		} else if !strings.Contains(err.Error(), "NUL") {
			t.Errorf("error %q does not say why", err)
		}
	}
	e := h.e
	h.close()
	if _, err := e.ListTasks("s", ListQuery{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("ListTasks on a closed engine: %v, want ErrClosed", err)
	}
}
