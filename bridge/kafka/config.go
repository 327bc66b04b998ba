// Package kafka is the Kafka adapter of the bridge, built on
// github.com/segmentio/kafka-go.
//
// The Source joins a consumer group with kafka-go's ConsumerGroup and
// Generation API and runs one worker per assigned partition. A worker seeks
// to max(committed offset, stored checkpoint + 1) (and commits that offset
// at once when the store is ahead), fetches record batches, hands each
// batch to the bridge Handler and commits offset+1 only after Handle
// returned nil and only while the generation that owns the partition is
// alive. A failed Handle is retried with backoff, never skipped. The
// checkpoint stored with the tasks makes ingest exactly-once into the store
// even when the process dies between the store commit and the offset
// commit. Fetching runs one batch ahead of the handler, so the next fetch
// overlaps the store's fsync.
//
// The Sink publishes a fire batch with one Writer.WriteMessages call,
// acks=all, the Java client's murmur2 key partitioning, and no topic
// auto-creation, so a missing target is a per-task publish error that the
// engine retries and eventually dead-letters.
//
// kafka-go behaviours this package works around:
//
//   - Reader, Conn and Batch read a null value and an empty value both as a
//     nil slice, so a tombstone cannot be told apart. The Source sends raw
//     Fetch requests through the Transport: protocol.Record.Value is nil
//     only for a null value. Client.Fetch would do too, but it drops the
//     aborted-transaction list, so aborted records would be read; the raw
//     response keeps it and the Source filters like a read_committed Java
//     consumer.
//   - A ConsumerGroup subscribed to a topic that does not exist assigns
//     nothing and starts generation after generation in a tight loop (its
//     partition watcher ends each one at once). Run waits until every
//     source topic exists (Health names the missing ones) before joining.
//   - A function passed to Generation.Start that returns ends the whole
//     generation, so partition workers return only when it ended or Run
//     stops.
//   - Writer.WriteMessages fails the whole call, not per message, on a
//     metadata error (unknown topic) or on one record above BatchBytes. The
//     Sink sends a record above BatchBytes in a batch of its own (a writer
//     without that limit: the broker's decides) and, on a whole-call
//     failure, retries topic by topic so that only the bad topic's tasks
//     fail.
//   - The Writer keeps writing a batch after the caller's ctx ended, and
//     retries with an uncancellable sleep; WriteAttempts and its backoff are
//     kept small because the engine has its own retry policy.
//   - The Transport refreshes its metadata cache only every MetadataTTL,
//     never when a broker answers "not leader", so after a leader move
//     every fetch and produce fails until the TTL runs out. On such errors
//     the Source and the Sink drop the transport's connection pools, which
//     reloads the metadata; the Sink then retries the failed records once.
//     A topic created since the last refresh is unknown to it meanwhile:
//     the Sink asks the brokers about such a topic before failing its
//     tasks as missing (Sink.recheckUnknown).
//   - kafka-go's sasl/scram needs github.com/xdg-go/scram, which is not a
//     dependency of this module; SCRAM uses franz-go's client (already a
//     dependency) behind kafka-go's sasl.Mechanism interface.
package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	fsasl "github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/metrics"
)

// Errors callers branch on. Connection errors wrap one of these and the
// kafka-go or crypto/tls cause.
var (
	// ErrConfig is wrapped by every configuration error.
	ErrConfig = errors.New("kafka: invalid config")
	// ErrAuth means the brokers refused the SASL credentials or mechanism,
	// or the user may not use a topic or the group (an authorization
	// failure).
	// Retrying does not help; Run returns it instead of looping.
	ErrAuth = errors.New("kafka: authentication or authorization failed")
	// ErrTLS means the TLS handshake failed (unknown CA, wrong host name,
	// refused client certificate, or a broker that does not speak TLS).
	ErrTLS = errors.New("kafka: tls handshake failed")
	// ErrUnreachable means no broker answered.
	ErrUnreachable = errors.New("kafka: no broker reachable")
	// ErrTopicMissing means a source topic does not exist. The source
	// waits for it (not ready) rather than joining the group without it.
	ErrTopicMissing = errors.New("kafka: source topic does not exist")
	// ErrNoTopic is the per-task error for a task without a target topic.
	ErrNoTopic = errors.New("kafka: task has no target topic")
	// ErrRunning is returned by a second concurrent Run.
	ErrRunning = errors.New("kafka: source already running")
	// ErrClosed is returned by Run after Close.
	ErrClosed = errors.New("kafka: closed")
)

// DefaultFetchMemory is Config.FetchMemory's default: 32 MiB, room for
// about three fetches of 1 MiB decoded on each of 10 partitions catching
// up at once (a few partitions never wait); more partitions take turns.
// A backlog over 256 partitions peaked at 137-161 MB of Go heap in use
// with it, against 423-445 MB without a bound (TestFetchMemoryHeapBacklog).
const DefaultFetchMemory = 32 << 20

// SourceConfig is one delay topic.
type SourceConfig struct {
	Topic string
	Rules *codec.Rules
}

// Config configures a Source and a Sink. Zero values take the documented
// defaults; Brokers is always required, Group and Sources for a Source.
type Config struct {
	Brokers  []string
	Group    string // consumer group id
	ClientID string // default "delaybridge"
	Sources  []SourceConfig
	// FreshStore says the store was created by this start
	// (shard.Engine.Fresh): a partition the group has read then has
	// tasks in another store, which the source logs as an error.
	FreshStore bool
	// MemberFile is where the source keeps its group member id, written
	// at each join: a start after a crash (kill -9, an OOM kill, a lost
	// node) removes the membership the crashed process left, instead of
	// waiting for its session to time out. "" keeps none.
	MemberFile string

	TLS *tls.Config // nil: plaintext
	// NewTLS, when set, wins over TLS: it gives each new connection its
	// TLS configuration, so files rotated under a running process (the CA
	// file, see config.ClientTLS) take effect at the next connection.
	NewTLS func() *tls.Config
	SASL   sasl.Mechanism // nil: no SASL

	// Source knobs.
	MaxBatch      int           // messages per Handle call; default 512
	FetchMaxBytes int           // decoded record bytes a partition fetches at once (see fetchSizer); default 1 MiB
	MaxWait       time.Duration // broker long-poll wait for an empty partition; default 500ms
	// FetchMemory bounds the bytes of records the source fetched and the
	// store has not taken yet, over all its partitions (fetchmem.go).
	// Default DefaultFetchMemory.
	FetchMemory int64
	// IdentityWait is how long one identity check long-polls for the
	// record at the checkpointed offset when nothing is readable there
	// yet, before it asks whether the log ends at that offset (then it is
	// another log) or reaches past it (then the worker waits and checks
	// again; see checkIdentity). A new leader's high watermark can trail
	// the old one's for up to the brokers' replica.lag.time.max.ms (30 s
	// by default). Default 30s.
	IdentityWait time.Duration
	// Linger is how long a worker waits for more records when a fetch
	// returned fewer than MaxBatch, so trickling traffic still makes
	// batches (one fsync each). Default 5ms; negative disables it.
	Linger            time.Duration
	HeartbeatInterval time.Duration // default 1s
	SessionTimeout    time.Duration // default 30s
	RebalanceTimeout  time.Duration // default 30s
	JoinBackoff       time.Duration // wait after a failed join; default 1s
	RetryMin          time.Duration // first backoff after a failed Handle or fetch; default 100ms
	RetryMax          time.Duration // backoff cap; default 10s

	// Sink knobs.
	BatchTimeout  time.Duration // producer linger; default 1ms (kafka-go's 1s default would delay every fire)
	BatchBytes    int64         // largest produce batch (a larger record goes alone, bounded by the broker); default 1 MiB (broker message.max.bytes)
	WriteAttempts int           // kafka-go internal attempts per produce batch; default 3
	WriteTimeout  time.Duration // per produce request; default 10s
	// ProbeInterval is how often an unhealthy Sink checks that every
	// partition of the topics whose publish failed has a leader and each
	// leader answers, so Health recovers without a publish. Default 5s.
	ProbeInterval time.Duration

	DialTimeout time.Duration // default 10s
	MetadataTTL time.Duration // producer metadata cache; default 6s

	Logger  *zap.Logger      // default zap.NewNop()
	Metrics *metrics.Metrics // default: unregistered instruments
}

func (c *Config) setDefaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if c.ClientID == "" {
		c.ClientID = "delaybridge"
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = 512
	}
	if c.FetchMaxBytes <= 0 {
		// Kafka's own consumer default per partition
		// (max.partition.fetch.bytes), counted decoded here (fetchSizer).
		// A partition worker holds up to two fetches (one being handed
		// over, one read ahead): with 4 MiB (stored bytes) the bridge's
		// peak RSS in bench was 690-740 MB against 570-580 MB, and fresh
		// memory costs page faults.
		c.FetchMaxBytes = 1 << 20
	}
	if c.FetchMemory <= 0 {
		c.FetchMemory = DefaultFetchMemory
	}
	def(&c.MaxWait, 500*time.Millisecond)
	def(&c.IdentityWait, 30*time.Second)
	def(&c.Linger, 5*time.Millisecond)
	def(&c.HeartbeatInterval, time.Second)
	def(&c.SessionTimeout, 30*time.Second)
	def(&c.RebalanceTimeout, 30*time.Second)
	def(&c.JoinBackoff, time.Second)
	def(&c.RetryMin, 100*time.Millisecond)
	def(&c.RetryMax, 10*time.Second)
	def(&c.BatchTimeout, time.Millisecond)
	if c.BatchBytes <= 0 {
		c.BatchBytes = 1 << 20
	}
	if c.WriteAttempts <= 0 {
		c.WriteAttempts = 3
	}
	def(&c.WriteTimeout, 10*time.Second)
	if c.ProbeInterval <= 0 {
		c.ProbeInterval = 5 * time.Second
	}
	def(&c.DialTimeout, 10*time.Second)
	def(&c.MetadataTTL, 6*time.Second)
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Metrics == nil {
		c.Metrics = metrics.New(nil)
	}
}

func (c *Config) validate(source bool) error {
	if len(c.Brokers) == 0 {
		return fmt.Errorf("%w: brokers: at least one broker address is required", ErrConfig)
	}
	for _, b := range c.Brokers {
		if _, _, err := net.SplitHostPort(b); err != nil {
			return fmt.Errorf("%w: brokers: %q is not host:port: %v", ErrConfig, b, err)
		}
	}
	if c.RetryMax < c.RetryMin {
		return fmt.Errorf("%w: retry max %s is below retry min %s", ErrConfig, c.RetryMax, c.RetryMin)
	}
	if !source {
		return nil
	}
	if c.Group == "" {
		return fmt.Errorf("%w: group: a consumer group id is required", ErrConfig)
	}
	if len(c.Sources) == 0 {
		return fmt.Errorf("%w: sources: at least one topic is required", ErrConfig)
	}
	seen := make(map[string]bool, len(c.Sources))
	for i, s := range c.Sources {
		if s.Topic == "" {
			return fmt.Errorf("%w: sources[%d]: topic is empty", ErrConfig, i)
		}
		if seen[s.Topic] {
			return fmt.Errorf("%w: sources[%d]: topic %q listed twice", ErrConfig, i, s.Topic)
		}
		seen[s.Topic] = true
	}
	return nil
}

func (c *Config) dialer() *kafkago.Dialer {
	d := &kafkago.Dialer{
		ClientID:      c.ClientID,
		Timeout:       c.DialTimeout,
		DualStack:     true,
		TLS:           c.TLS,
		SASLMechanism: c.SASL,
	}
	if c.NewTLS != nil {
		d.TLS, d.DialFunc = nil, dialTLS(c.NewTLS, net.Dialer{})
	}
	return d
}

// perAddressDial is the cap on one address's connect and TLS handshake in
// the per-connection TLS dial (a variable for tests).
var perAddressDial = 3 * time.Second

// transportIdle is how long kafka-go keeps an idle connection open. It
// also bounds how long a connection pool dropped by CloseIdleConnections
// (a Close, a reload of stale metadata after a leader moved: Source and
// Sink do that on each such failure) stays in memory: kafka-go does not
// stop an idle connection's timer when it closes it, and the timer holds
// the pool with its metadata until it fires. At 5 min, 100 drops on a
// cluster of 2 000 partitions held 64 MB for 5 min (hunt H208: 640 KB a
// drop, of the whole cluster's metadata, which Source and Sink no longer
// read); this is kafka-go's own default. A publisher idle longer
// than this reconnects at its next publish.
const transportIdle = 30 * time.Second

func (c *Config) transport() *kafkago.Transport {
	t := &kafkago.Transport{
		ClientID:    c.ClientID,
		DialTimeout: c.DialTimeout,
		IdleTimeout: transportIdle,
		MetadataTTL: c.MetadataTTL,
		TLS:         c.TLS,
		SASL:        c.SASL,
	}
	if c.NewTLS != nil {
		// kafka-go's own Transport dial caps each address's connect at
		// 3 s (its defaultDialer), so that a hanging bootstrap broker
		// leaves time for the next one within DialTimeout: so does this
		// one, and its TLS handshake too (a broker that accepts and then
		// says nothing).
		t.TLS, t.Dial = nil, dialTLS(c.NewTLS, net.Dialer{Timeout: perAddressDial})
	}
	return t
}

// dialTLS dials a broker and completes the TLS handshake with the
// configuration newTLS gives for this connection, naming the broker's
// host as the server when the configuration names none, as kafka-go does
// with a fixed configuration (so an address by IP is checked against the
// certificate's IP addresses). With d.Timeout set the handshake gets that
// long as well, besides the connect.
func dialTLS(newTLS func() *tls.Config, d net.Dialer) func(ctx context.Context, network, address string) (net.Conn, error) {
	return func(ctx context.Context, network, address string) (net.Conn, error) {
		conn, err := d.DialContext(ctx, network, address)
		if err != nil {
			return nil, err
		}
		cfg := newTLS()
		if cfg.ServerName == "" {
			host, _, err := net.SplitHostPort(address)
			if err != nil {
				host = address
			}
			cfg.ServerName = host
		}
		tc := tls.Client(conn, cfg)
		hctx := ctx
		if d.Timeout > 0 {
			var cancel context.CancelFunc
			hctx, cancel = context.WithTimeout(ctx, d.Timeout)
			defer cancel()
		}
		if err := tc.HandshakeContext(hctx); err != nil {
			conn.Close()
			return nil, err
		}
		return tc, nil
	}
}

// TLSConfig builds a client TLS configuration from PEM files. caFile
// (optional) replaces the system roots; certFile and keyFile (both or
// neither) are the client certificate for mutual TLS; serverName overrides
// the name checked in the broker certificate; insecure skips verification
// and is meant for development only.
func TLSConfig(caFile, certFile, keyFile, serverName string, insecure bool) (*tls.Config, error) {
	cfg, err := config.TLS{CAFile: caFile, CertFile: certFile, KeyFile: keyFile, ServerName: serverName, InsecureSkipVerify: insecure}.Build()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return cfg, nil
}

// SASLMechanism builds a SASL mechanism: PLAIN, SCRAM-SHA-256 or
// SCRAM-SHA-512 (case-insensitive). An empty mechanism means no SASL and
// returns nil. Error messages never contain the password.
func SASLMechanism(mechanism, user, pass string) (sasl.Mechanism, error) {
	return SASLMechanismFunc(mechanism, user, func() string { return pass })
}

// SASLMechanismFunc is SASLMechanism with the password asked of pass at
// each authentication (each new connection), so a password rotated in a
// file (config.SecretFunc) is used from the next connection on.
func SASLMechanismFunc(mechanism, user string, pass func() string) (sasl.Mechanism, error) {
	if mechanism == "" {
		return nil, nil
	}
	if user == "" {
		return nil, fmt.Errorf("%w: sasl %s: user is empty", ErrConfig, mechanism)
	}
	switch m := strings.ToUpper(mechanism); m {
	case "PLAIN":
		return plainMechanism{user: user, pass: pass}, nil
	case "SCRAM-SHA-256", "SCRAM-SHA-512":
		return scramMechanism{name: m, user: user, pass: pass}, nil
	}
	return nil, fmt.Errorf("%w: sasl mechanism %q: want PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512", ErrConfig, mechanism)
}

// plainMechanism is kafka-go's PLAIN with the password of the moment.
type plainMechanism struct {
	user string
	pass func() string
}

func (p plainMechanism) Name() string { return "PLAIN" }

func (p plainMechanism) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	return plain.Mechanism{Username: p.user, Password: p.pass()}.Start(ctx)
}

// scramMechanism adapts franz-go's SCRAM client to kafka-go's
// sasl.Mechanism. kafka-go's own sasl/scram package needs
// github.com/xdg-go/scram, which is not a dependency of this module;
// franz-go already is (kfake), and its SCRAM client uses only the standard
// library. The two interfaces have the same shape: a client-first message,
// then one call per server challenge until done.
type scramMechanism struct {
	name string // SCRAM-SHA-256 or SCRAM-SHA-512
	user string
	pass func() string
}

func (s scramMechanism) Name() string { return s.name }

func (s scramMechanism) Start(ctx context.Context) (sasl.StateMachine, []byte, error) {
	host := ""
	if md := sasl.MetadataFromContext(ctx); md != nil {
		host = net.JoinHostPort(md.Host, fmt.Sprint(md.Port))
	}
	auth := scram.Auth{User: s.user, Pass: s.pass()}
	m := auth.AsSha256Mechanism()
	if s.name == "SCRAM-SHA-512" {
		m = auth.AsSha512Mechanism()
	}
	sess, first, err := m.Authenticate(ctx, host)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: start: %w", s.name, err)
	}
	return scramSession{sess}, first, nil
}

type scramSession struct{ s fsasl.Session }

func (s scramSession) Next(_ context.Context, challenge []byte) (bool, []byte, error) {
	return s.s.Challenge(challenge)
}

// check dials the brokers in order until one answers, authenticates and
// reads the cluster's brokers, then asks that broker whether each of topics
// exists. It
// classifies the failure as ErrAuth, ErrTLS or ErrUnreachable.
func check(ctx context.Context, c *Config, topics []string) error {
	d := c.dialer()
	var errs []error
	for _, addr := range c.Brokers {
		conn, err := d.DialContext(ctx, "tcp", addr)
		if err != nil {
			errs = append(errs, classify(fmt.Errorf("dial %s: %w", addr, err)))
			if ctx.Err() != nil {
				break
			}
			continue
		}
		c.setDeadline(ctx, conn)
		_, err = conn.Brokers()
		_ = conn.Close()
		if err == nil && len(topics) > 0 {
			// Not conn.ReadPartitions: its metadata request allows topic
			// auto-creation, so on a broker with
			// auto.create.topics.enable a missing source topic would be
			// created (with the broker's default partition count) instead
			// of reported.
			err = readTopicsNoCreate(ctx, c, addr, topics)
		}
		if err != nil {
			err = classify(fmt.Errorf("kafka: read metadata from %s: %w", addr, err))
			if errors.Is(err, ErrAuth) || errors.Is(err, ErrTLS) || errors.Is(err, ErrTopicMissing) {
				return err
			}
			// A connection lost or refused while asking: the next broker
			// may answer; if none does, the brokers are unreachable
			// (retried), not a reason to stop.
			errs = append(errs, err)
			if ctx.Err() != nil {
				break
			}
			continue
		}
		return nil
	}
	err := errors.Join(errs...)
	if errors.Is(err, ErrAuth) || errors.Is(err, ErrTLS) {
		return fmt.Errorf("kafka: connect: %w", err)
	}
	return fmt.Errorf("%w: %w", ErrUnreachable, err)
}

// setDeadline bounds a check's exchange on conn by ctx's deadline, or
// DialTimeout without one.
func (c *Config) setDeadline(ctx context.Context, conn *kafkago.Conn) {
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	} else {
		_ = conn.SetDeadline(time.Now().Add(c.DialTimeout))
	}
}

// readTopicsNoCreate reports the topics that do not exist by name, asking
// the broker at addr for the first offset of each one's partition 0: a
// ListOffsets, unlike a Metadata request from kafka-go (which allows
// auto-creation), never creates a topic. A partition led by another broker
// answers NotLeaderForPartition: the topic exists.
func readTopicsNoCreate(ctx context.Context, c *Config, addr string, topics []string) error {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return err
	}
	d := c.dialer()
	var missing []string
	for _, t := range topics {
		conn, err := d.DialPartition(ctx, "tcp", addr, kafkago.Partition{Topic: t, ID: 0, Leader: kafkago.Broker{Host: host, Port: port}})
		if err != nil {
			return err
		}
		c.setDeadline(ctx, conn)
		_, err = conn.ReadFirstOffset()
		_ = conn.Close()
		switch {
		case err == nil, errors.Is(err, kafkago.NotLeaderForPartition), errors.Is(err, kafkago.LeaderNotAvailable),
			errors.Is(err, kafkago.ReplicaNotAvailable):
		case errors.Is(err, kafkago.UnknownTopicOrPartition):
			missing = append(missing, t)
		default:
			return fmt.Errorf("topic %q: %w", t, err)
		}
	}
	if len(missing) > 0 {
		return &topicsMissingError{topics: missing}
	}
	return nil
}

// topicsMissingError is ErrTopicMissing with the topics that are missing.
type topicsMissingError struct{ topics []string }

func (e *topicsMissingError) Error() string {
	return ErrTopicMissing.Error() + ": " + strings.Join(e.topics, ", ")
}

func (e *topicsMissingError) Unwrap() error { return ErrTopicMissing }

// missingTopics returns the topics err says are missing (none for another
// error or nil).
func missingTopics(err error) []string {
	var m *topicsMissingError
	if errors.As(err, &m) {
		return m.topics
	}
	return nil
}

// classify wraps err with ErrAuth or ErrTLS when it is one of those
// permanent failures.
func classify(err error) error {
	if err == nil || errors.Is(err, ErrAuth) || errors.Is(err, ErrTLS) {
		return err
	}
	if fatal := fatalKind(err); fatal != nil {
		return fmt.Errorf("%w: %w", fatal, err)
	}
	return err
}

func fatalKind(err error) error {
	switch {
	case errors.Is(err, kafkago.SASLAuthenticationFailed),
		errors.Is(err, kafkago.UnsupportedSASLMechanism),
		errors.Is(err, kafkago.IllegalSASLState),
		errors.Is(err, kafkago.TopicAuthorizationFailed),
		errors.Is(err, kafkago.GroupAuthorizationFailed),
		errors.Is(err, kafkago.ClusterAuthorizationFailed):
		return ErrAuth
	}
	var (
		unknownCA  x509.UnknownAuthorityError
		hostname   x509.HostnameError
		invalid    x509.CertificateInvalidError
		verify     *tls.CertificateVerificationError
		header     tls.RecordHeaderError
		alert      tls.AlertError
		echReject  *tls.ECHRejectionError
		sysRootErr x509.SystemRootsError
	)
	switch {
	case errors.As(err, &unknownCA), errors.As(err, &hostname), errors.As(err, &invalid),
		errors.As(err, &verify), errors.As(err, &header), errors.As(err, &alert),
		errors.As(err, &echReject), errors.As(err, &sysRootErr):
		return ErrTLS
	}
	// An alert from the broker (e.g. "certificate required" when mutual
	// TLS is on and we sent no client certificate) reaches us as an
	// unexported crypto/tls type; its text is all there is to match.
	if strings.Contains(err.Error(), "remote error: tls: ") {
		return ErrTLS
	}
	return nil
}

// zapLogger adapts a zap logger to kafka-go's Printf-style Logger.
func zapLogger(l *zap.Logger, level func(*zap.Logger, string)) kafkago.Logger {
	return kafkago.LoggerFunc(func(format string, args ...any) {
		level(l, fmt.Sprintf(format, args...))
	})
}

// throttledLogger is zapLogger throttled per format string: kafka-go's
// error logger says the same on every retry of a failing operation (a
// coordinator it cannot reach), once per JoinBackoff.
func throttledLogger(l *zap.Logger, level func(*zap.Logger, string)) kafkago.Logger {
	var th logthrottle.Throttle
	return kafkago.LoggerFunc(func(format string, args ...any) {
		if n, ok := th.AllowKey(time.Now(), format); ok {
			msg := fmt.Sprintf(format, args...)
			if n > 0 {
				msg += fmt.Sprintf(" (%d repeated lines not logged)", n)
			}
			level(l, msg)
		}
	})
}

func logDebug(l *zap.Logger, msg string) { l.Debug(msg) }
func logWarn(l *zap.Logger, msg string)  { l.Warn(msg) }

// backoff doubles d up to max.
func backoff(d, maxD time.Duration) time.Duration {
	d *= 2
	if d > maxD || d <= 0 {
		return maxD
	}
	return d
}

// sleep waits d or until ctx ends; it reports whether the wait completed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
