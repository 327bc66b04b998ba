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
// Messages are pulled with the Messages iterator, which keeps the next
// batch in flight while the handler makes the current one durable. A batch
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
// backoff and marked in progress so the server does not redeliver it; on
// shutdown an unhandled batch is nak'ed (after the pull subscription is
// gone) for quick redelivery to the next run.
//
// Each batch carries the checkpoint "nats|STREAM|FILTERS", a stream
// sequence at or below which every message is held by the store or acked.
// It is a floor rather than the highest sequence handled, because
// JetStream redelivers unacked messages behind newer ones: after a crash a
// message the store never got can arrive after higher sequences were
// handled. Messages at or below the floor are acked without being handed
// over, so redeliveries of what the store already holds are not ingested
// again. See floorState for how the floor is proven from consumer sequences
// and the server's ack floor.
//
// # Sink
//
// Deliver publishes a fire batch with JetStream async publishes, at most
// Config.PublishWindow in flight, and returns after every PubAck (or
// Config.PublishTimeout), with one error per task.
//
// Extension of the contract: each delivery carries Nats-Msg-Id =
// "<delay-id>|<delay-due>". A task delivered again after a crash (its
// deletion from the store was not yet durable) is then dropped by the
// target stream's duplicate window, while a later firing of the same id has
// another due time and is not. The source message's own Nats-Msg-Id and the
// other JetStream publish directives (Nats-Expected-*, Nats-TTL,
// Nats-Rollup, Nats-Schedule*, Nats-Batch-*, Nats-Incr,
// Nats-Required-Api-Level) are not forwarded: they addressed the publish to
// the delay stream, and on the target they would make the delivery fail
// (an expected last sequence) or change its meaning.
//
// Best effort: a target subject that no stream captures cannot be
// acknowledged. The Sink learns which subjects streams capture from the
// account's stream list (read at most once per Config.NoStreamTTL, 30 s)
// and delivers to the others with a core NATS publish and one flush per
// batch, counted in delaybridge_best_effort_deliveries_total. A subscriber
// that is not listening at that moment misses the message. A JetStream
// publish that meets "no responders" or times out makes the next Deliver
// read the list again, so a stream created or deleted later is noticed.
package nats
