package nats

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"time"

	natsgo "github.com/nats-io/nats.go"
	"go.uber.org/zap"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/logthrottle"
	"github.com/delaybridge/delaybridge/metrics"
)

// Errors callers branch on. They are wrapped with context; test with errors.Is.
var (
	// ErrConfig reports an invalid Config.
	ErrConfig = errors.New("nats: invalid config")
	// ErrAuth reports that the server refused the credentials at connect.
	// The error also wraps the nats.go error (natsgo.ErrAuthorization, ...).
	ErrAuth = errors.New("nats: authentication refused")
	// ErrNoStream reports that the delay stream does not exist and Create
	// is off.
	ErrNoStream = errors.New("nats: delay stream not found")
	// ErrNoConsumer reports that the durable consumer does not exist and
	// Create is off.
	ErrNoConsumer = errors.New("nats: durable consumer not found")
	// ErrDisconnected is what Health reports while the connection is down.
	ErrDisconnected = errors.New("nats: disconnected")
	// ErrWrongTransport is returned by Sink.Deliver for a task that is not
	// aimed at NATS.
	ErrWrongTransport = errors.New("nats: task transport is not nats")
	// ErrPublishTimeout is returned for a delivery whose PubAck did not
	// arrive within Config.PublishTimeout.
	ErrPublishTimeout = errors.New("nats: publish ack timeout")
	// ErrNoTargetStream is returned by Sink.Deliver for a task whose
	// subject no JetStream stream captures, when it may not go out with
	// core NATS: a target while Config.CoreTargets is off, and every dead
	// letter. It is the task's own failure (not shard.ErrUnavailable): the
	// engine retries it with backoff and dead-letters a target as
	// publish-failed once the retry policy is exhausted, and keeps a dead
	// letter, reporting not-ready, until it can be delivered.
	ErrNoTargetStream = errors.New("no JetStream stream captures subject")
)

// SourceConfig is one delay source: a subject filter on the delay stream.
type SourceConfig struct {
	// Subject is a NATS subject filter; it may contain * and >.
	Subject string
	// Rules apply to the messages whose subject matches Subject. When
	// filters overlap, the first matching source wins.
	Rules *codec.Rules
}

// Config configures the connection, the Source and the Sink. Zero values
// take the defaults written next to each field.
type Config struct {
	URL  string // server URL(s), comma separated; default nats://127.0.0.1:4222
	Name string // connection name shown by the server; default "delaybridge"

	Stream   string // JetStream stream holding the delay subjects (Source)
	Consumer string // durable pull consumer name (Source)
	// Create creates the stream (or adds missing subjects to it) and
	// creates or updates the consumer. Without it both must exist.
	Create bool
	// Replicas is the replica count of the stream Create makes; when set
	// (1-5) Create also scales an existing stream to it. 0: a new stream
	// gets one replica (JetStream's default), an existing one keeps its
	// count. On a NATS cluster give 3 (or 5), so the delay stream
	// survives the loss of a server.
	Replicas int
	Sources  []SourceConfig

	// Authentication: at most one of User/Password, Token, CredsFile
	// (JWT + nkey seed) and NkeyFile (nkey seed file).
	User      string
	Password  string
	Token     string
	CredsFile string
	NkeyFile  string
	// PasswordFunc and TokenFunc, when set, win over Password and Token:
	// they are asked at each connect and reconnect, so a secret rotated
	// in a file (config.SecretFunc) is used from the next one on.
	PasswordFunc func() string
	TokenFunc    func() string
	TLS          *tls.Config // nil: plain TCP unless the URL says tls://
	// RootCAs, when set with TLS, gives the CA pool of each connect and
	// reconnect (config.ClientTLS.RootCAsFunc: the CA file as it is then).
	RootCAs func() (*x509.CertPool, error)

	BatchSize int // max messages per Handle call; default 256
	// BatchBytes ends a batch once its messages' data and headers reach
	// it (at least one message). Default 4 MiB.
	BatchBytes int
	// PullBytes bounds what the source's pull requests bring in at once,
	// counted in messages of the server's max_payload: a pull asks for
	// 2 x BatchSize messages, or as many of that size as fit (at least
	// 2; see pullMessages). Default 64 MiB: 63 messages at the default
	// 1 MiB max_payload, 512 up to a max_payload of about 124 KiB.
	PullBytes int
	// Linger is how long the Source waits for more messages to fill a batch
	// once it has one; default 2ms. It bounds the added ingest latency.
	Linger        time.Duration
	MaxAckPending int           // consumer max ack pending; default 20000
	AckWait       time.Duration // consumer ack wait; default 30s (kept alive while a batch is handled)
	// PullExpiry is the life of one pull request at the server; the
	// server sends heartbeats at half of it, and two missed ones end the
	// pull: a connection that then leaves a ping unanswered for
	// ConnectTimeout is reconnected (half-open), else the consumer is
	// asked whether it is there. Default 10s.
	PullExpiry time.Duration

	PublishWindow  int           // publishes in flight per Deliver call; default 512
	PublishTimeout time.Duration // max wait for the PubAcks of a Deliver call; default 10s
	// CoreTargets lets a delivery to a target subject that no JetStream
	// stream captures go out with core NATS: best effort, unacknowledged,
	// lost if nobody is subscribed. Off (the default), such a delivery
	// fails with ErrNoTargetStream, so the task stays in the store and is
	// retried, then dead-lettered as publish-failed. Dead letters never go
	// out with core NATS, whatever this says.
	CoreTargets bool
	// NoStreamTTL is how long a target subject found without a stream is
	// treated as such (delivered with core NATS, or failed at once) before
	// JetStream is tried again; default 30s.
	NoStreamTTL time.Duration

	ConnectTimeout time.Duration // default 5s; also how long the source waits for a ping's answer (see PullExpiry)
	ReconnectWait  time.Duration // default 1s

	Logger  *zap.Logger      // default zap.NewNop()
	Metrics *metrics.Metrics // default: unregistered instruments
}

func (c *Config) setDefaults() {
	if c.URL == "" {
		c.URL = natsgo.DefaultURL
	}
	if c.Name == "" {
		c.Name = "delaybridge"
	}
	if c.BatchSize <= 0 {
		c.BatchSize = 256
	}
	if c.BatchBytes <= 0 {
		c.BatchBytes = 4 << 20
	}
	if c.PullBytes <= 0 {
		c.PullBytes = 64 << 20
	}
	if c.Linger <= 0 {
		c.Linger = 2 * time.Millisecond
	}
	if c.MaxAckPending <= 0 {
		c.MaxAckPending = 20000
	}
	if c.AckWait <= 0 {
		c.AckWait = 30 * time.Second
	}
	if c.PullExpiry <= 0 {
		c.PullExpiry = 10 * time.Second
	}
	if c.PublishWindow <= 0 {
		c.PublishWindow = 512
	}
	if c.PublishTimeout <= 0 {
		c.PublishTimeout = 10 * time.Second
	}
	if c.NoStreamTTL <= 0 {
		c.NoStreamTTL = 30 * time.Second
	}
	if c.ConnectTimeout <= 0 {
		c.ConnectTimeout = 5 * time.Second
	}
	if c.ReconnectWait <= 0 {
		c.ReconnectWait = time.Second
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	if c.Metrics == nil {
		c.Metrics = metrics.New(nil)
	}
}

// validateSource checks what the Source needs beyond the connection.
func (c *Config) validateSource() error {
	if c.Stream == "" {
		return fmt.Errorf("%w: stream is required", ErrConfig)
	}
	if strings.ContainsAny(c.Stream, ".*> \t") {
		return fmt.Errorf("%w: stream %q: must not contain '.', '*', '>' or spaces", ErrConfig, c.Stream)
	}
	if c.Consumer == "" {
		return fmt.Errorf("%w: consumer is required", ErrConfig)
	}
	if strings.ContainsAny(c.Consumer, ".*> \t") {
		return fmt.Errorf("%w: consumer %q: must not contain '.', '*', '>' or spaces", ErrConfig, c.Consumer)
	}
	if len(c.Sources) == 0 {
		return fmt.Errorf("%w: at least one source subject is required", ErrConfig)
	}
	for i, s := range c.Sources {
		if !validFilter(s.Subject) {
			return fmt.Errorf("%w: sources[%d].subject %q is not a valid subject filter", ErrConfig, i, s.Subject)
		}
	}
	return nil
}

// options builds the nats.go connect options. Secrets go into the options
// only, never into a log line or an error.
func (c *Config) options() ([]natsgo.Option, error) {
	methods := 0
	if c.User != "" || c.Password != "" || c.PasswordFunc != nil {
		methods++
		if c.User == "" {
			return nil, fmt.Errorf("%w: password set without user", ErrConfig)
		}
	}
	for _, set := range []bool{c.Token != "" || c.TokenFunc != nil, c.CredsFile != "", c.NkeyFile != ""} {
		if set {
			methods++
		}
	}
	if methods > 1 {
		return nil, fmt.Errorf("%w: set only one of user/password, token, creds file and nkey file", ErrConfig)
	}

	log := c.Logger
	var reconnectFails logthrottle.Throttle
	// drops throttles "disconnected" and "reconnected" (see dropLog).
	drops := &dropLog{log: log, every: dropLogEvery, reset: reconnectFails.Reset}
	// asyncErrs throttles the other async errors per text: the server
	// answers each publish to a subject the user may not publish to with
	// one (the sink notes it; the engine logs the refusal per target), so
	// a backlog due for a denied subject made a line per task and retry
	// (hunt H204: 2846 a minute for 1000 tasks). A denied publish's text
	// is keyed without its subject (asyncErrorKey): with a subject per
	// entity, each made its own key, up to 65 lines per 30 s (review R200).
	var asyncErrs logthrottle.Throttle
	opts := []natsgo.Option{
		natsgo.Name(c.Name),
		natsgo.Timeout(c.ConnectTimeout),
		// After a successful start the bridge never gives up on its broker.
		natsgo.MaxReconnects(-1),
		natsgo.ReconnectWait(c.ReconnectWait),
		// A credential rotated on the server must not end the connection
		// for good: keep trying and keep saying why in the log.
		natsgo.IgnoreAuthErrorAbort(),
		natsgo.DisconnectErrHandler(func(nc *natsgo.Conn, err error) {
			if err == nil && nc.IsClosed() {
				return // closed by its owner; the closed handler says so
			}
			drops.dropped(err)
		}),
		natsgo.ReconnectHandler(func(nc *natsgo.Conn) {
			drops.reconnected(redactURL(nc.ConnectedUrl()))
		}),
		natsgo.ReconnectErrHandler(func(_ *natsgo.Conn, err error) {
			// Once per ReconnectWait for as long as the server is down:
			// the first, then one line per logthrottle.DefaultEvery and
			// error shape (an error naming the client's ephemeral port,
			// new at each attempt, is one failure; so are a cluster's
			// servers failing alike, review R210).
			if suppressed, ok := reconnectFails.AllowKey(time.Now(), logthrottle.Shape(err.Error())); ok {
				drops.attemptLogged()
				log.Warn("nats: reconnect attempt failed", zap.Error(err), zap.Int("held_back", suppressed))
			}
		}),
		natsgo.ClosedHandler(func(nc *natsgo.Conn) {
			var f []zap.Field
			if held := drops.close(); held > 0 {
				f = append(f, zap.Int("drops_held_back", held))
			}
			if err := nc.LastError(); err != nil {
				log.Warn("nats: connection closed", append(f, zap.Error(err))...)
				return
			}
			log.Info("nats: connection closed", f...)
		}),
		natsgo.ErrorHandler(func(nc *natsgo.Conn, sub *natsgo.Subscription, err error) {
			if sub == nil && !nc.IsConnected() {
				// A reconnect the server refused (credentials rotated
				// on the server before the file, an expired JWT, a
				// client certificate it no longer takes): nats.go
				// reports it here, not to ReconnectErrHandler, at every
				// attempt, once per ReconnectWait and server. Throttled
				// as a failed reconnect is.
				if suppressed, ok := reconnectFails.AllowKey(time.Now(), logthrottle.Shape(err.Error())); ok {
					drops.attemptLogged()
					log.Warn("nats: reconnect attempt failed", zap.Error(err), zap.Int("held_back", suppressed))
				}
				return
			}
			key := asyncErrorKey(err)
			f := []zap.Field{zap.Error(err)}
			if sub != nil {
				key += "\x00" + sub.Subject
				f = append(f, zap.String("subject", sub.Subject))
			}
			suppressed, forgotten, ok := asyncErrs.AllowEachForgotten(time.Now(), key)
			if !ok {
				return
			}
			log.Warn("nats: async error", append(f, zap.Int("held_back", suppressed), logthrottle.Forgotten(forgotten))...)
		}),
	}
	switch {
	case c.User != "" && c.PasswordFunc != nil:
		user, pass := c.User, c.PasswordFunc
		opts = append(opts, natsgo.UserInfoHandler(func() (string, string) { return user, pass() }))
	case c.User != "":
		opts = append(opts, natsgo.UserInfo(c.User, c.Password))
	case c.TokenFunc != nil:
		opts = append(opts, natsgo.TokenHandler(c.TokenFunc))
	case c.Token != "":
		opts = append(opts, natsgo.Token(c.Token))
	case c.CredsFile != "":
		if _, err := os.Stat(c.CredsFile); err != nil {
			return nil, fmt.Errorf("%w: creds file: %w", ErrConfig, err)
		}
		opts = append(opts, natsgo.UserCredentials(c.CredsFile))
	case c.NkeyFile != "":
		opt, err := natsgo.NkeyOptionFromSeed(c.NkeyFile)
		if err != nil {
			return nil, fmt.Errorf("%w: nkey file %s: %w", ErrConfig, c.NkeyFile, err)
		}
		opts = append(opts, opt)
	}
	if c.TLS != nil {
		opts = append(opts, natsgo.Secure(c.TLS))
		if c.RootCAs != nil {
			// Keeps the configuration Secure set, and replaces its
			// RootCAs at each connect.
			opts = append(opts, natsgo.ClientTLSConfig(nil, c.RootCAs))
		}
	}
	return opts, nil
}

// Connect opens the connection the Source and the Sink share. It fails at
// once on an unreachable server or refused credentials (ErrAuth); after a
// successful start it reconnects forever, logging each change.
func Connect(cfg Config) (*natsgo.Conn, error) {
	cfg.setDefaults()
	opts, err := cfg.options()
	if err != nil {
		return nil, err
	}
	nc, err := natsgo.Connect(cfg.URL, opts...)
	if err != nil {
		if isAuthError(err) {
			return nil, fmt.Errorf("%w: connect to %s: %w", ErrAuth, redactURL(cfg.URL), err)
		}
		return nil, fmt.Errorf("nats: connect to %s: %w", redactURL(cfg.URL), err)
	}
	cfg.Logger.Info("nats: connected", zap.String("server", redactURL(nc.ConnectedUrl())),
		zap.String("server_id", nc.ConnectedServerId()))
	// Also without nats.tls: a tls:// URL or a server that requires TLS
	// verifies against the system's roots.
	go logTLSRefusals(nc, cfg.Logger)
	return nc, nil
}

// logTLSRefusals logs the reconnect attempts whose TLS handshake failed
// once they reached a server: its certificate from a CA not (yet) in the
// CA file, say, the server's CA rotated before the file. nats.go reports
// those to no handler (the handshake fails in its connect step, after the
// dial), only in LastError, which /readyz shows; without this the log
// would say "disconnected; reconnecting" and never why. Each failed
// attempt ends in a RECONNECTING status with that error. Logged once,
// then once per logthrottle.DefaultEvery until connected again, whatever
// the error: its text may name the attempt's local port (a server that
// closed the connection after the handshake), so a throttle per distinct
// text would log every attempt. It ends with the connection.
func logTLSRefusals(nc *natsgo.Conn, log *zap.Logger) {
	ch := nc.StatusChanged(natsgo.RECONNECTING, natsgo.CONNECTED, natsgo.CLOSED)
	defer nc.RemoveStatusListener(ch)
	if nc.IsClosed() {
		return // closed before the listener was registered: no CLOSED to wait for
	}
	var fails logthrottle.Throttle
	for st := range ch {
		switch st {
		case natsgo.CLOSED:
			return
		case natsgo.CONNECTED:
			fails.Reset()
		case natsgo.RECONNECTING:
			if err := nc.LastError(); errors.Is(err, natsgo.ErrTLS) {
				if suppressed, ok := fails.Allow(time.Now()); ok {
					log.Warn("nats: reconnect attempt failed", zap.Error(err), zap.Int("held_back", suppressed))
				}
			}
		}
	}
}

func isAuthError(err error) bool {
	return errors.Is(err, natsgo.ErrAuthorization) || errors.Is(err, natsgo.ErrAuthExpired) ||
		errors.Is(err, natsgo.ErrAuthRevoked) || errors.Is(err, natsgo.ErrAccountAuthExpired)
}

// redactURL drops user info from each URL of a comma separated list.
func redactURL(s string) string {
	parts := strings.Split(s, ",")
	for i, p := range parts {
		p = strings.TrimSpace(p)
		u, err := url.Parse(p)
		switch {
		case err == nil && u.User != nil && !strings.Contains(u.Host+u.Path+u.RawQuery+u.Fragment, "@"):
			u.User = nil
			parts[i] = u.String()
		case strings.Contains(p, "@"):
			// Unparsable, or a "/", "?" or "#" in a token or password
			// ended the user information early (a second "@" after it):
			// all before the last "@" may be credential.
			parts[i] = "[url with credentials]"
			if at, scheme := strings.LastIndex(p, "@"), strings.Index(p, "://"); scheme >= 0 && at > scheme {
				parts[i] = p[:scheme+len("://")] + "REDACTED" + p[at:]
			}
		default:
			parts[i] = p
		}
	}
	return strings.Join(parts, ",")
}

// connErr is the health of a connection: nil when connected. While it
// reconnects it names the last attempt's error when there is one (nats.go
// keeps it only for an attempt that reached a server: refused credentials,
// a failed TLS handshake), so that /readyz says why the server refuses the
// bridge rather than only that it is reconnecting. The error is text, not
// wrapped: callers branch on ErrDisconnected (an outage), and a refusal
// while reconnecting is one too (it heals once the credentials or
// certificates are rotated, with no restart).
func connErr(nc *natsgo.Conn) error {
	st := nc.Status()
	if st == natsgo.CONNECTED {
		return nil
	}
	if last := nc.LastError(); last != nil {
		return fmt.Errorf("%w: connection %s: last attempt: %v", ErrDisconnected, strings.ToLower(st.String()), last)
	}
	return fmt.Errorf("%w: connection %s", ErrDisconnected, strings.ToLower(st.String()))
}

// asyncErrorKey is the throttle key of an async error: its text, with
// the subject of a denied publish left out, so that refusals of many
// subjects (one per order, per tenant) are one failure to throttle; the
// line logged names the first subject in its error.
func asyncErrorKey(err error) string {
	text := err.Error()
	if !errors.Is(err, natsgo.ErrPermissionViolation) {
		return text
	}
	if loc := publishDeniedRe.FindStringSubmatchIndex(text); loc != nil {
		return text[:loc[2]] + "<subject>" + text[loc[3]:]
	}
	return text
}
