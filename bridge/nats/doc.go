// Package nats is the NATS JetStream adapter of the bridge: a Source that
// reads the delay subjects of one stream through a durable pull consumer,
// and a Sink that delivers due tasks with JetStream publishes acknowledged
// by PubAck.
//
// # Connection
//
// Connect opens the one connection Source and Sink share. Credentials are
// user/password, token, a creds file (JWT + nkey seed) or an nkey seed
// file, optionally over TLS. A refused credential or an unreachable server
// fails Connect at once (ErrAuth wraps the nats.go authorization error);
// after a successful start the connection reconnects forever and logs every
// disconnect, reconnect and failed attempt. Health of Source and Sink is
// non-nil while it is down. Secrets never reach a log line or an error:
// URLs are printed without their user info.
//
// # Source
//
// The consumer is an explicit-ack pull consumer filtered on the source
// subjects, MaxDeliver -1 (the server never drops a message the bridge has
// not taken) and a large MaxAckPending. With Config.Create the stream (a
// work-queue stream: once acked, the bridge's store holds the message) and
// the consumer are created, or updated where possible; without it both
// must exist and a missing one is an error naming it (ErrNoStream,
// ErrNoConsumer).
//
// Messages are pulled with pull requests the source issues itself (see
// puller), which keep the next batch in flight while the handler makes
// the current one durable, and never drop a message, however long the
// handler holds a batch. A batch
// is the first available message plus what arrives within Config.Linger
// (2 ms), up to Config.BatchSize; it is handed over sorted by stream
// sequence. Each message becomes a codec.Message with Source = stream,
// Partition 0, Offset = stream sequence, Time = stored time, Headers from
// the NATS headers (repeated values as repeated entries, keys sorted since
// NATS keeps headers in a map), and the Rules of the first source whose
// subject filter matches.
//
// A batch is acked only after Handle returned nil: one fire-and-forget
// ack per message, pipelined on the connection, so no round trip per
// message or per batch. While Handle fails, the batch is retried with
// backoff and marked in progress so the server does not redeliver it, every
// third of the consumer's redelivery wait as the server reports it (AckWait,
// or the shortest BackOff step; the consumer may be an operator's); on
// shutdown an unhandled batch is nak'ed (after the pull subscription is
// gone) for quick redelivery to the next run.
//
// Each batch carries the checkpoint "nats|STREAM|FILTERS|CREATED" (see
// CheckpointKey), a stream sequence at or below which every message is
// held by the store or acked.
// It is a floor rather than the highest sequence handled, because
// JetStream redelivers unacked messages behind newer ones: after a crash a
// message the store never got can arrive after higher sequences were
// handled. Messages at or below the floor are acked without being handed
// over, so redeliveries of what the store already holds are not ingested
// again. See floorState for how the floor is proven from consumer sequences
// and the server's ack floor.
//
// CREATED, the stream's creation time, binds the floor to one incarnation
// of the stream: one deleted and created again numbers from 1. The source
// reads it at start and whenever consuming restarts, and a delivery whose
// consumer sequence goes back (another consumer of the same name) stops
// the batch, unacked, until it has; a new identity resets the floor. A
// floor an older version stored without the identity is kept only if the
// consumer has delivered past it, else dropped (floorState.adoptLegacy).
//
// # Sink
//
// Deliver publishes a fire batch with JetStream async publishes, at most
// Config.PublishWindow in flight, and returns after every PubAck (or
// Config.PublishTimeout), with one error per task. A publish still
// without its PubAck once every other one of the batch has its answer
// gets a short grace and then fails as a PubAck timeout (see the
// stragglers in Deliver).
//
// Extension of the contract: each delivery carries Nats-Msg-Id =
// "<transport>:<source>|<delay-id>|<delay-due>" (see DeliveryID: the
// source is the delay topic or stream, since ids are scoped to it, and
// '%', '|', space and control characters of each part are
// percent-encoded). A task delivered again after a crash (its deletion
// from the store was not yet durable) is then dropped by the target
// stream's duplicate window, while a later firing of the same id (another
// due time) and a task of another source with the same id and due time
// are not. A dead letter has its origin in place of the delay-id, so that
// the DLQ stream drops only a redelivery of the same dead letter. The source message's own Nats-Msg-Id and the other JetStream
// publish directives (Nats-Expected-*, Nats-TTL, Nats-Rollup,
// Nats-Schedule*, Nats-Batch-*, Nats-Incr, Nats-Required-Api-Level,
// Nats-Trace-*) are not forwarded, nor is the Nats-Stream-Source that
// JetStream adds to the messages of a delay stream that sources another,
// nor the headers by which a RePublish or a direct get says where a
// message is stored (Nats-Stream, Nats-Subject, Nats-Sequence,
// Nats-Time-Stamp, Nats-Last-Sequence, Nats-Msg-Size, Nats-Num-Pending,
// Nats-UpTo-Sequence: on the target they would precede the target's own):
// they addressed the publish to the delay stream, or came with its copy,
// and on the target they would make the delivery fail (an expected last
// sequence; a stream source header, which every stream refuses) or
// change its meaning (a trace-only publish is traced, not stored; a
// Nats-Trace-Dest makes the server publish a trace event on a subject
// targets.allow never checked).
//
// Subjects without a stream: a subject that no stream captures cannot
// acknowledge a delivery. Every subject is published with JetStream first,
// since only the server knows whether a stream captures it (subject
// mappings, imported streams, domains). When no stream answers ("no
// responders", or no PubAck within a second while core subscribers
// received the message) the Sink asks the server whether one of the
// account's streams captures the subject ($JS.API.STREAM.NAMES with a
// subject filter, its own 2 s timeout). Only if none does is the subject
// without a stream, and this finding stands for Config.NoStreamTTL (30 s),
// during which the subject is not tried with JetStream again:
//
//   - By default the delivery fails with ErrNoTargetStream ("no JetStream
//     stream captures subject X; create one or set nats.core_targets").
//     It is the task's own failure, not an outage: the engine retries it
//     with backoff and, once the retry policy is exhausted, dead-letters it
//     as publish-failed. Nothing is deleted without an acknowledgement
//     (core subscribers may see the JetStream publishes of its tries).
//   - With Config.CoreTargets (nats.core_targets) a target is best effort:
//     the message is (or was) published with core NATS and one flush per
//     batch, counted in delaybridge_best_effort_deliveries_total; a
//     subscriber that is not listening at that moment misses it.
//   - A dead letter always fails with ErrNoTargetStream, whatever
//     CoreTargets says: it is the last copy of its message. The engine
//     keeps it, retries it with backoff and reports not-ready until a
//     stream captures the DLQ subject.
//
// A stream that captures the subject but does not answer, a subject a
// stream acknowledged within NoStreamTTL, or a lookup that failed (kept
// for NoStreamTTL, e.g. without the permission) make the task fail as
// unavailable, so it waits without using its retry budget instead of
// being published without a PubAck or failed on a guess.
//
// Failures for want of a working server wrap shard.ErrUnavailable: no
// connection, publish or flush failing on a closed, reconnecting or
// draining connection, no PubAck in time (while the caller's context is
// live), "no responders" for a subject a stream captures, and JetStream
// answering 503 for itself. A stream's refusal (its limits with
// DiscardNew, an expected sequence, the account's storage) does not, even
// where the server answers it with 503.
package nats
