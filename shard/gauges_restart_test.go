package shard

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/metrics"
)

// checkGauges fails when a gauge of m says other than the engine: pending,
// wheel entries and held tasks per shard against Stats, the failing and
// parked dead letters and undecodable entries against StuckEntries, firing
// paused against FiringPaused.
func checkGauges(t *testing.T, when string, m *metrics.Metrics, e *Engine) {
	t.Helper()
	st := e.Stats()
	for _, s := range st.Shards {
		label := strconv.Itoa(s.Shard)
		var held float64
		for _, tr := range []codec.Transport{codec.TransportKafka, codec.TransportNATS} {
			held += testutil.ToFloat64(m.Held.WithLabelValues(label, tr.String()))
		}
		for _, c := range []struct {
			name      string
			got, want float64
		}{
			{"delaybridge_pending_tasks", testutil.ToFloat64(m.Pending.WithLabelValues(label)), float64(s.Pending)},
			{"delaybridge_wheel_entries", testutil.ToFloat64(m.InWheel.WithLabelValues(label)), float64(s.InWheel)},
			{"delaybridge_held_tasks", held, float64(s.Held)},
		} {
			if c.got != c.want {
				t.Errorf("%s: %s{shard=%q} = %v, the engine has %v", when, c.name, label, c.got, c.want)
			}
		}
	}
	var failing, parked, undecodable float64
	for _, s := range stuckOf(t, e) {
		switch s.State {
		case StuckHeld:
			failing++
		case StuckParked:
			parked++
		case StuckUndecodable:
			undecodable++
		}
	}
	paused := 0.0
	if e.FiringPaused() {
		paused = 1
	}
	for _, c := range []struct {
		name      string
		got, want float64
	}{
		{"delaybridge_dead_letters_failing", testutil.ToFloat64(m.DeadLettersFailing), failing},
		{"delaybridge_dead_letters_parked", testutil.ToFloat64(m.DeadLettersParkedNow), parked},
		{"delaybridge_undecodable_entries", testutil.ToFloat64(m.Undecodable), undecodable},
		{"delaybridge_firing_paused", testutil.ToFloat64(m.FiringPaused), paused},
	} {
		if c.got != c.want {
			t.Errorf("%s: %s = %v, the engine has %v", when, c.name, c.got, c.want)
		}
	}
}

// TestGaugesTellTheTruthAfterRestart: the engine's gauges (pending, wheel
// entries, held tasks, failing and parked dead letters, undecodable
// entries, firing paused) say what the engine holds while it runs, after a Close and
// reopen in the same process (one Metrics, as a service that reopens its
// store keeps), and after a crash (the store as last synced); and the
// counters add up once everything is delivered (hunt H200). Before,
// delaybridge_firing_paused stayed 1 after an engine closed while paused:
// the reopened engine, not paused, was reported paused for good. Before
// H202 no gauge counted the failing dead letters (a DLQ that fails as a
// whole) at all: Err and GET /v1/stuck were the only ways to see them.
func TestGaugesTellTheTruthAfterRestart(t *testing.T) {
	for _, crash := range []bool{false, true} {
		t.Run(map[bool]string{false: "close", true: "crash"}[crash], func(t *testing.T) {
			m := metrics.New(prometheus.NewRegistry())
			mem := vfs.NewCrashableMem()
			h := newHarness(t, func(o *Options) {
				o.Metrics = m
				o.FS = mem
				o.Shards = 2
				o.OutageMemory = 2
				o.FireBatch = 8
				o.Retry = parkPolicy
			})
			down := fmt.Errorf("broker down: %w", ErrUnavailable)
			refused := fmt.Errorf("kafka: publish to \"dlq\": %w: message too large", ErrRefused)
			up := false
			h.sink.setFail(func(t *codec.Task) error {
				switch {
				case t.Kind == codec.KindDeadLetter && t.Target == "dlqdenied" && !up:
					return errDLQDenied // the DLQ fails as a whole: held, never parked
				case t.Kind == codec.KindDeadLetter && !up:
					return refused
				case t.Target == "down" && !up:
					return down
				}
				return nil
			})
			var batch []codec.Task
			n := int64(0)
			add := func(id string, due time.Time, target string) {
				n++
				tk := sched(id, due, n)
				tk.Target = target
				batch = append(batch, tk)
			}
			const downN, laterN, farN = 20, 5, 5
			for i := range downN {
				add(fmt.Sprintf("down%02d", i), t0.Add(time.Second), "down")
			}
			for i := range laterN { // within the horizon
				add(fmt.Sprintf("later%d", i), t0.Add(5*time.Minute), "out")
			}
			for i := range farN { // beyond it
				add(fmt.Sprintf("far%d", i), t0.Add(30*24*time.Hour), "out")
			}
			n++
			batch = append(batch, deadLetter("bad", n))
			n++
			denied := deadLetter("denied", n)
			denied.Target = "dlqdenied"
			batch = append(batch, denied)
			h.ingest(batch)
			checkGauges(t, "ingested", m, h.e)
			h.run()
			h.advanceUntil("held tasks, the park and the failing dead letter", func() bool {
				if h.e.Stats().Held == 0 || testutil.ToFloat64(m.DeadLettersParkedNow) != 1 {
					return false
				}
				for _, s := range stuckOf(t, h.e) {
					if s.State == StuckHeld {
						return true
					}
				}
				return false
			})
			checkGauges(t, "running, target down, dead letters parked and failing", m, h.e)
			if st := h.e.Stats(); st.Held == 0 || st.Pending != downN+laterN+farN+2 {
				t.Fatalf("before the restart: %+v, want held tasks and every task pending", st)
			}
			h.e.PauseFiring() // a restart during the catch-up pause
			checkGauges(t, "paused", m, h.e)

			if crash {
				h.crashReopen(mem)
			} else {
				h.stop()
				h.reopen()
			}
			checkGauges(t, "reopened", m, h.e)
			h.run()
			h.advance(time.Second)
			checkGauges(t, "running again, target still down", m, h.e)

			up = true
			h.set(t0.Add(31 * 24 * time.Hour)) // the far ones due too
			h.advanceUntil("everything delivered", func() bool { return h.e.Stats().Pending == 0 })
			checkGauges(t, "all delivered", m, h.e)
			h.checkPending()
			for _, c := range []struct {
				name      string
				got, want float64
			}{
				{"ingested", testutil.ToFloat64(m.Ingested.WithLabelValues("src")), float64(len(batch))},
				{"fired task", testutil.ToFloat64(m.Fired.WithLabelValues("kafka", "task")), downN + laterN + farN},
				{"fired dlq", testutil.ToFloat64(m.Fired.WithLabelValues("kafka", "dlq")), 2},
				{"dead lettered", testutil.ToFloat64(m.DeadLettered.WithLabelValues(string(codec.CodeBadDue))), 2},
				{"parked total", testutil.ToFloat64(m.DeadLettersParked), 1},
			} {
				if c.got != c.want {
					t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
				}
			}
		})
	}
}
