// Package metrics holds the Prometheus instruments of CONTRACT §7 and a few
// more. One Metrics is built per process and handed to the engine, the
// pipeline and the admin server; tests build their own on a fresh registry.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/delaybridge/delaybridge/codec"
)

// Buckets for latencies that matter in milliseconds (fire lateness, store
// commits, publishes): 0.5 ms to 60 s.
var latencyBuckets = []float64{
	0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
}

// Metrics are the bridge's instruments. The zero value is not usable; call New.
type Metrics struct {
	Ingested     *prometheus.CounterVec // source
	Fired        *prometheus.CounterVec // transport, target kind (task|dlq)
	DeadLettered *prometheus.CounterVec // reason
	// DeadLettersParked counts each time a dead letter entered the parked
	// set: its DLQ refused it as this message (too large, a record the
	// broker rejects) at its Retry.MaxAttempts-th attempt or later, so its
	// source commits past it. DeadLettersParkedNow is how many are parked
	// now (in the store, retried, not yet in their DLQ).
	DeadLettersParked    prometheus.Counter
	DeadLettersParkedNow prometheus.Gauge
	// DeadLettersFailing is how many dead letters whose last delivery
	// failed, and that are not parked, wait in the store for a retry now:
	// their DLQ fails as a whole (unreachable, no permission, no stream,
	// full) or has not refused them Retry.MaxAttempts times yet.
	DeadLettersFailing  prometheus.Gauge
	Cancelled           *prometheus.CounterVec   // source
	Replaced            *prometheus.CounterVec   // source
	Dropped             *prometheus.CounterVec   // source, why (older, cancelled)
	Pending             *prometheus.GaugeVec     // shard
	InWheel             *prometheus.GaugeVec     // shard
	Held                *prometheus.GaugeVec     // shard, transport
	FireLateness        *prometheus.HistogramVec // transport
	Overdue             prometheus.Counter
	StoreCommit         *prometheus.HistogramVec // op (ingest|fire|retry|cancel|drop)
	StoreErrors         prometheus.Counter
	PublishRetries      *prometheus.CounterVec   // transport
	PublishSeconds      *prometheus.HistogramVec // transport
	BestEffort          *prometheus.CounterVec   // transport: deliveries with no broker ack (core NATS)
	SourceErrors        *prometheus.CounterVec   // source
	SourceLag           *prometheus.GaugeVec     // source, partition
	SourceUnstable      *prometheus.GaugeVec     // source, partition (Kafka)
	SourceStableStalled *prometheus.GaugeVec     // source, partition (Kafka)
	// SourceFetchMemory is what the Kafka source fetched and the store has
	// not taken yet, by state: counted against kafka.fetch_memory_mb, or
	// stuck (held by partitions whose batch waits for its DLQ or is
	// retried after a non-store error, not counted). SourceFetchMemoryLimit is the budget, and
	// SourceFetchMemoryWaits counts fetches that waited for it.
	SourceFetchMemory      *prometheus.GaugeVec // state (counted|stuck)
	SourceFetchMemoryLimit prometheus.Gauge
	SourceFetchMemoryWaits prometheus.Counter
	Ready                  prometheus.Gauge
	// FiringPaused is 1 while firing is paused: the fire loops wait for the
	// sources to read their backlog at start (catch_up_wait), or an
	// operator paused firing (FiringPausedByOperator). Due tasks wait
	// meanwhile.
	FiringPaused prometheus.Gauge
	// FiringPausedByOperator is 1 while an operator's pause holds firing
	// (admin POST /v1/firing/pause), kept across restarts until resumed.
	FiringPausedByOperator prometheus.Gauge
	// FiringPausedByOperatorSince is the start of that pause (Unix
	// seconds, the bridge's clock), 0 without one: it survives restarts,
	// so an alert on the pause's age does too.
	FiringPausedByOperatorSince prometheus.Gauge

	// StuckDropped counts the stuck entries an operator removed from the
	// store (admin DELETE /v1/stuck/...), by their state then: held or
	// parked dead letters, undecodable envelopes.
	StuckDropped *prometheus.CounterVec // state
	// Undecodable is how many stored entries the fire loops found with an
	// envelope that does not decode (since the process started: the set
	// lives in memory and is found again after a restart as the entries
	// come due).
	Undecodable prometheus.Gauge
	// StoreDisk exports the free space of data_dir's volume and the
	// store's size, read at each scrape from the open engine.
	StoreDisk *StoreDiskCollector
}

// New builds the instruments and registers them on r (nil: not registered).
func New(r prometheus.Registerer) *Metrics {
	m := &Metrics{
		Ingested: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_ingested_total", Help: "Source messages durably taken in (tasks, cancels and dead letters).",
		}, []string{"source"}),
		Fired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_fired_total", Help: "Tasks delivered to their target and acknowledged by the broker (kind=task), and dead letters taken by their DLQ (kind=dlq).",
		}, []string{"transport", "kind"}),
		DeadLettered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_dead_lettered_total", Help: "Messages written to a dead-letter destination, by reason code.",
		}, []string{"reason"}),
		DeadLettersParked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "delaybridge_dead_letters_parked_total", Help: "Dead letters parked: their DLQ refused them as the message they are (too large, a record the broker rejects; not: unreachable, no permission, no stream, full) at the last attempt of the retry policy or later. Their source commits past them; they stay in the store and are retried until the DLQ takes them.",
		}),
		Undecodable: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_undecodable_entries", Help: "Stored tasks and dead letters whose envelope does not decode, found by the fire loops since start: they cannot be delivered and stay in the store (an awaited dead letter among them holds its source) until dropped with DELETE /v1/stuck/{shard}/{seq}.",
		}),
		DeadLettersParkedNow: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_dead_letters_parked", Help: "Dead letters parked now (see delaybridge_dead_letters_parked_total): in the store, retried, not yet in their DLQ. Stored with each retry, so it survives a restart.",
		}),
		DeadLettersFailing: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_dead_letters_failing", Help: "Dead letters whose last delivery to their DLQ failed, not parked (their DLQ fails as a whole: unreachable, no permission, no stream, full; or refused them fewer times than the retry policy allows): in the store, retried with backoff; one a source partition waits for holds it. The bridge is not ready while any is. Stored with each retry, so it survives a restart.",
		}),
		StuckDropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_stuck_dropped_total", Help: "Stuck store entries an operator dropped for good through the admin API (DELETE /v1/stuck/{shard}/{seq}), by state: held (a dead letter whose DLQ fails), parked (a dead letter its DLQ refuses as this message), undecodable (an envelope that cannot be decoded). A dead letter dropped while being published that its DLQ took anyway counts as dead-lettered instead.",
		}, []string{"state"}),
		Cancelled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_cancelled_total", Help: "Pending tasks cancelled (by delay-cancel, tombstone or admin API) and not delivered; one already being published when cancelled counts here only if that publish failed, else as fired.",
		}, []string{"source"}),
		Replaced: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_replaced_total", Help: "Pending tasks replaced by a newer schedule with the same id and not delivered; one already being published when replaced counts here only if that publish failed, else as fired.",
		}, []string{"source"}),
		Dropped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_dropped_total", Help: "Schedules dropped because a newer schedule or cancel with the same id was already held.",
		}, []string{"source", "why"}),
		Pending: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "delaybridge_pending_tasks", Help: "Tasks held in the store, waiting to fire, dead letters waiting for their DLQ included.",
		}, []string{"shard"}),
		InWheel: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "delaybridge_wheel_entries", Help: "Entries in the in-memory timing wheel (tasks due within the horizon).",
		}, []string{"shard"}),
		Held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "delaybridge_held_tasks", Help: "Pending tasks held on disk, out of the wheel, because their target broker was unreachable and the shard already kept its share of retry.waiting_in_memory waiting in memory; released, per target, once a probe or a delivery to that target succeeds.",
		}, []string{"shard", "transport"}),
		FireLateness: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "delaybridge_fire_lateness_seconds", Help: "Broker acknowledgement time minus due time of delivered tasks (retries and outages included; dead letters not). A task published already overdue (delay-at in the past, counted by delaybridge_overdue_total) counts from its source broker time instead.",
			Buckets: latencyBuckets,
		}, []string{"transport"}),
		Overdue: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "delaybridge_overdue_total", Help: "Tasks whose due time had already passed when they were ingested.",
		}),
		StoreCommit: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "delaybridge_store_commit_seconds", Help: "Duration of synced store commits.",
			Buckets: latencyBuckets,
		}, []string{"op"}),
		StoreErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "delaybridge_store_errors_total", Help: "Store write failures; the first one makes the store refuse writes.",
		}),
		PublishRetries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_publish_retries_total", Help: "Fire-time publishes that failed and were rescheduled with backoff, per task: attempts charged to the retry policy and waits for an unreachable target broker (no attempt charged) alike; the last attempt, which dead-letters, is not counted.",
		}, []string{"transport"}),
		PublishSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "delaybridge_publish_seconds", Help: "Duration of a fire batch publish, until the broker acknowledged it or, for a batch that failed (in whole or in part), until the last answer, refusal or timeout: a p99 that nears the publish timeout is a target that does not answer.",
			Buckets: latencyBuckets,
		}, []string{"transport"}),
		BestEffort: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_best_effort_deliveries_total", Help: "Deliveries with no broker acknowledgement (a NATS subject without a JetStream stream).",
		}, []string{"transport"}),
		SourceErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "delaybridge_source_errors_total", Help: "Errors fetching from or committing to a delay source.",
		}, []string{"source"}),
		SourceLag: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "delaybridge_source_lag_messages", Help: "Messages in a delay source not yet taken in; on Kafka up to the last stable offset (read_committed: records behind an open transaction are not readable yet and not counted), reported by the member that reads the partition (0 elsewhere), refreshed every second while the partition is held. On NATS the JetStream consumer's pending count (while a batch is held: refreshed every second, as pending plus delivered but not acked), which every instance sharing the consumer reports: take the max per source and partition over instances, not the sum.",
		}, []string{"source", "partition"}),
		SourceUnstable: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "delaybridge_source_unstable_messages", Help: "Kafka: offsets of a delay partition between its last stable offset and its high watermark, i.e. behind an open transaction; read_committed takes none of them in (nor anything after them) until the transaction ends. 0 while no transaction is open.",
		}, []string{"source", "partition"}),
		SourceStableStalled: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "delaybridge_source_stable_offset_stalled_seconds", Help: "Kafka: how long a delay partition's last stable offset has not moved while records lie beyond it (an open transaction holds the partition), timed from when this member first saw it (it holds its last value while fetches fail); 0 when nothing is held. Longer than the broker's transaction.max.timeout.ms means a hanging transaction: the partition's delays after it are not taken in.",
		}, []string{"source", "partition"}),
		SourceFetchMemory: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "delaybridge_source_fetch_memory_bytes", Help: "Kafka: bytes of records the source fetched (and reserved for fetches in flight) that the store has not taken yet, by state: counted against kafka.fetch_memory_mb, or stuck (held by partitions whose batch has waited over a second for its dead-letter topic, or is retried after an error other than the store's; not counted, so they hold no other partition back). Counted may pass the budget by about a fetch (the broker returns a fetch's first batch whole; a stuck partition's bytes count again once its batch is stored) and by idle partitions' long polls past half the budget, 16 KiB each.",
		}, []string{"state"}),
		SourceFetchMemoryLimit: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_source_fetch_memory_limit_bytes", Help: "Kafka: the source's fetch memory budget (kafka.fetch_memory_mb) in bytes.",
		}),
		SourceFetchMemoryWaits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "delaybridge_source_fetch_memory_waits_total", Help: "Kafka: fetches that waited for room in the source's fetch memory budget (kafka.fetch_memory_mb). A rate that stays up while partitions lag: the budget, not the store, paces the intake.",
		}),
		Ready: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_ready", Help: "1 when the bridge is ready (recovered, store and sources healthy).",
		}),
		FiringPaused: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_firing_paused", Help: "1 while firing is paused: at start while the sources read what they held (at most catch_up_wait), so a cancel or replace in that backlog stops the task it names before it fires, or by an operator (delaybridge_firing_paused_by_operator); due tasks wait meanwhile.",
		}),
		FiringPausedByOperator: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_firing_paused_by_operator", Help: "1 while an operator's pause holds firing (admin POST /v1/firing/pause, kept in the store across restarts until POST /v1/firing/resume); due tasks wait meanwhile.",
		}),
		FiringPausedByOperatorSince: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "delaybridge_firing_paused_by_operator_since_seconds", Help: "When the operator's pause of firing began (Unix seconds, kept across restarts), 0 without one.",
		}),
		StoreDisk: newStoreDiskCollector(),
	}
	// Every reason exists from the start at 0, so a rate() or increase()
	// alert on one sees its first dead letter instead of a series that
	// appears with it.
	for _, c := range codec.Codes {
		m.DeadLettered.WithLabelValues(string(c))
	}
	for _, st := range []string{"held", "parked", "undecodable"} {
		m.StuckDropped.WithLabelValues(st)
	}
	if r != nil {
		r.MustRegister(m.Ingested, m.Fired, m.DeadLettered, m.DeadLettersParked, m.DeadLettersParkedNow, m.DeadLettersFailing, m.StuckDropped, m.Undecodable, m.Cancelled, m.Replaced, m.Dropped,
			m.Pending, m.InWheel, m.Held, m.FireLateness, m.Overdue, m.StoreCommit, m.StoreErrors,
			m.PublishRetries, m.PublishSeconds, m.BestEffort, m.SourceErrors, m.SourceLag, m.SourceUnstable, m.SourceStableStalled,
			m.SourceFetchMemory, m.SourceFetchMemoryLimit, m.SourceFetchMemoryWaits, m.Ready, m.FiringPaused, m.FiringPausedByOperator, m.FiringPausedByOperatorSince, m.StoreDisk)
	}
	return m
}

// InitSeries creates at 0 the series, for the given delay sources and
// target transports, of the counters and histograms that dashboards and
// alerts rely on (CONTRACT §7: ingested, fired, cancelled, fire lateness,
// publish retries; and replaced and source errors beside them), as New
// does for every dead-letter reason. A series that appears with its first
// event makes a rate() or increase() miss that event (the publish-retry
// alert could not see a first retry), and a dashboard shows "no data"
// rather than 0 until traffic comes.
func (m *Metrics) InitSeries(sources, transports []string) {
	for _, src := range sources {
		m.Ingested.WithLabelValues(src)
		m.Cancelled.WithLabelValues(src)
		m.Replaced.WithLabelValues(src)
		m.SourceErrors.WithLabelValues(src)
		for _, why := range DroppedWhy {
			m.Dropped.WithLabelValues(src, why)
		}
	}
	for _, tr := range transports {
		m.Fired.WithLabelValues(tr, "task")
		m.Fired.WithLabelValues(tr, "dlq")
		m.FireLateness.WithLabelValues(tr)
		m.PublishRetries.WithLabelValues(tr)
		m.PublishSeconds.WithLabelValues(tr)
		m.BestEffort.WithLabelValues(tr)
	}
}

// DroppedWhy are the why labels of delaybridge_dropped_total: a schedule
// dropped for an older one than the id's stored version, or for a cancel
// remembered.
var DroppedWhy = []string{"older", "cancelled"}
