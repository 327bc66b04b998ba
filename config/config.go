// Package config is delaybridge's operator configuration: the YAML schema of
// CONTRACT §5 plus extensions, defaults, DELAYBRIDGE_* environment overrides,
// secrets read from files, and Validate, whose errors name the offending key
// path ("kafka.sources[0].dlq: required") so an operator can fix everything
// in one pass.
//
// The YAML is decoded by a small schema-driven walker over yaml.v3 nodes
// rather than by yaml.v3's struct decoder: it refuses unknown and duplicate
// keys like KnownFields(true) does, but also names the key path and line of
// every type error, and it shares the scalar parsing with the environment
// overrides so a value means the same in both places.
//
// Rules an operator can rely on:
//
//   - Defaults are in place before the YAML is read, so an explicit zero
//     (retry.jitter: 0, max_delay: 0) is kept. A key with a null value
//     (kafka: ~, or "kafka:" with nothing under it) is as if omitted;
//     when that leaves no transport, Validate names the empty block and
//     what it lacks ("kafka: empty: ...; set kafka.brokers ...").
//   - The kafka and nats blocks are pointers: omitted means the transport
//     is disabled; present (even empty, or enabled by one environment
//     variable) means enabled, with defaults for group, client_id, url,
//     stream and consumer.
//   - Environment: DELAYBRIDGE_ + the upper-case key path joined by "_"
//     (DELAYBRIDGE_KAFKA_SASL_PASSWORD). Lists of names are comma-separated
//     (DELAYBRIDGE_KAFKA_BROKERS=a:9092,b:9092; an empty value is the empty
//     list; "\," is a comma within an item, kept escaped, as a
//     targets.allow pattern for a NATS subject with a comma needs it);
//     lists of blocks take an index (DELAYBRIDGE_KAFKA_SOURCES_0_DLQ),
//     and an index past the end grows the list. Environment beats YAML.
//     Every DELAYBRIDGE_ variable must name a key.
//   - Durations are Go durations or whole days: "90s", "365d", "2d12h".
//   - *_file keys (kafka.sasl.password_file, nats.password_file,
//     nats.token_file, admin.token_file, admin.metrics_token_file) are
//     read at load, one trailing newline ("\n" or "\r\n") trimmed;
//     setting both the secret and its file is refused. The service reads
//     them again when they change (SecretFunc), as it does the TLS CA
//     file (ClientTLS).
//     Secrets have type Secret, which prints as "REDACTED".
package config

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"time"

	"go.uber.org/zap/zapcore"
	"gopkg.in/yaml.v3"
)

// Config is the whole configuration. Durations accept days ("365d").
// Zero-valued blocks Kafka and NATS mean the transport is disabled.
type Config struct {
	// DataDir holds the durable store. Required.
	DataDir string `yaml:"data_dir"`
	// Shards is the number of engine shards, 1..1024. Default 8.
	Shards int `yaml:"shards"`
	// Horizon bounds memory: tasks due later stay on disk. Default 10m.
	Horizon Duration `yaml:"horizon"`
	// MaxDelay bounds how far in the future a task may be due; 0 = no
	// bound. Default 365d.
	MaxDelay Duration `yaml:"max_delay"`
	// MaxMessageBytes bounds key + value + headers (each with its framing)
	// of a source message as delivered.
	// Default DefaultMaxMessageBytes (1 MiB less 1 KiB).
	MaxMessageBytes int `yaml:"max_message_bytes"`
	// CancelRetention is how long a cancel that arrived before its schedule
	// is remembered. Default 24h.
	CancelRetention Duration `yaml:"cancel_retention"`
	// FireBatch is the largest number of tasks published at once. Default 512.
	FireBatch int `yaml:"fire_batch"`
	// FireBatchBytes bounds the stored tasks (bytes, plus 40 a header) a
	// shard's fire loop reads into memory a round; the rest wait for the
	// next. Default DefaultFireBatchBytes (4 MiB).
	FireBatchBytes int `yaml:"fire_batch_bytes"`
	// Store sizes the store's memory.
	Store Store `yaml:"store"`
	// Retry is the backoff for fire-time publish failures.
	Retry Retry `yaml:"retry"`
	// ShutdownTimeout bounds the graceful stop. Default 10s.
	ShutdownTimeout Duration `yaml:"shutdown_timeout"`
	// CatchUpWait bounds the pause of firing at start while the sources
	// read what they held (a backlog built up while the bridge was down),
	// so a cancel or replace in it stops the overdue task it names before
	// that task fires. 0 fires at once. Default DefaultCatchUpWait.
	CatchUpWait Duration `yaml:"catch_up_wait"`
	Log         Log      `yaml:"log"`
	Kafka       *Kafka   `yaml:"kafka,omitempty"`
	NATS        *NATS    `yaml:"nats,omitempty"`
	Targets     Targets  `yaml:"targets"`
	Admin       Admin    `yaml:"admin"`
}

// Store sizes the memory of the Pebble store. The process's resident
// memory is about CacheMB plus the Go heap (a few hundred MB under load).
type Store struct {
	// CacheMB is Pebble's block cache, from which the memtables are
	// reserved. Default 768.
	CacheMB int `yaml:"cache_mb"`
	// MemtableMB is one memtable (two are in memory: one filling, one
	// flushing); tasks fired while theirs is in memory never reach a
	// file; after a crash, the ones replayed from the WAL are flushed
	// before the bridge is ready. At most cache_mb/2. Default 128, or
	// cache_mb/2 when cache_mb is under 256.
	MemtableMB int `yaml:"memtable_mb"`
	// ReserveMB is the free space (MiB, for an unprivileged user) the
	// bridge leaves on data_dir's volume: below it, it takes no message
	// in (sources retry, nothing committed or acked, not ready) until a
	// tenth more is free again, while due tasks still fire and are
	// deleted. It keeps room for the write-ahead logs Pebble
	// preallocates at 1.1 × memtable_mb and for flushes, since a write
	// that fails on a full volume stops the store until a restart.
	// Default StoreReserveMB(memtable_mb): two logs, 2 × 1.1 ×
	// memtable_mb rounded up (282 with the default memtable); 0: none.
	ReserveMB int `yaml:"reserve_mb"`
}

// StoreReserveMB is the default store.reserve_mb for a memtable of
// memtableMB: room for two write-ahead logs, 2 × 1.1 × memtableMB rounded
// up.
func StoreReserveMB(memtableMB int) int { return (22*memtableMB + 9) / 10 }

// Retry is the publish retry policy.
type Retry struct {
	Initial     Duration `yaml:"initial"`      // default 500ms
	Max         Duration `yaml:"max"`          // default 5m
	Multiplier  float64  `yaml:"multiplier"`   // >= 1; default 2
	Jitter      float64  `yaml:"jitter"`       // [0, 1); default 0.2
	MaxAttempts int      `yaml:"max_attempts"` // >= 1; default 10
	// WaitingInMemory bounds the tasks waiting for an unreachable target
	// broker that the bridge keeps in memory (110-290 bytes each), over
	// all shards; the next ones are held on disk only and released once
	// a delivery to their target succeeds. 0: every such task is held on
	// disk. Default DefaultWaitingInMemory.
	WaitingInMemory int `yaml:"waiting_in_memory"`
}

// DefaultWaitingInMemory is retry.waiting_in_memory's default (110-290
// bytes each, docs/benchmarks.md "Memory through a target outage").
const DefaultWaitingInMemory = 1 << 19

// Log configures the process logger.
type Log struct {
	Level  string `yaml:"level"`  // debug|info|warn|error; default info
	Format string `yaml:"format"` // json|console; default json
}

// TLS configures a client TLS connection. The files are paths; they are
// loaded by Validate as the start loads them (a CA file without a
// certificate, a certificate and key that are no pair are refused), and
// again by the transport adapter, at each connection (Client).
type TLS struct {
	Enabled            bool   `yaml:"enabled"`
	CAFile             string `yaml:"ca_file"`
	CertFile           string `yaml:"cert_file"`
	KeyFile            string `yaml:"key_file"`
	ServerName         string `yaml:"server_name"`
	InsecureSkipVerify bool   `yaml:"insecure_skip_verify"`
}

// SASL configures Kafka authentication.
type SASL struct {
	// Mechanism is "", "PLAIN", "SCRAM-SHA-256" or "SCRAM-SHA-512", in
	// any case.
	Mechanism string `yaml:"mechanism"`
	Username  string `yaml:"username"`
	Password  Secret `yaml:"password"`
	// PasswordFile is read by Load into Password.
	PasswordFile string `yaml:"password_file"`
}

// Kafka is the Kafka transport; nil disables it.
type Kafka struct {
	Brokers  []string      `yaml:"brokers"`   // required
	Group    string        `yaml:"group"`     // default "delaybridge"
	ClientID string        `yaml:"client_id"` // default "delaybridge"
	TLS      TLS           `yaml:"tls"`
	SASL     SASL          `yaml:"sasl"`
	Sources  []KafkaSource `yaml:"sources"` // at least one
	// FetchMemoryMB bounds what the source fetched and the store has not
	// taken yet, over all its partitions (MiB, 1..65536). Default
	// DefaultKafkaFetchMemoryMB.
	FetchMemoryMB int `yaml:"fetch_memory_mb"`
}

// KafkaSource is one delay topic.
type KafkaSource struct {
	Topic string `yaml:"topic"`
	// DLQ is the dead-letter topic. Required.
	DLQ string `yaml:"dlq"`
	// DefaultTarget is used when a message names no delay-target.
	DefaultTarget string `yaml:"default_target"`
}

// NATS is the NATS JetStream transport; nil disables it.
type NATS struct {
	URL      string `yaml:"url"`      // default nats://localhost:4222; comma-separated list allowed
	Stream   string `yaml:"stream"`   // default "DELAY"
	Consumer string `yaml:"consumer"` // durable name; default "delaybridge"
	// Create makes the bridge create the stream and consumer if missing.
	Create bool `yaml:"create"`
	// Replicas (1-5, with Create) is the replica count of the stream
	// the bridge creates, and of an existing one it scales; 0: one for a
	// new stream, an existing one's left alone.
	Replicas int `yaml:"replicas"`
	// CoreTargets lets a delivery to a target subject that no JetStream
	// stream captures go out as a core NATS publish: best effort, no
	// acknowledgement, lost without a subscriber. Default false: such a
	// task is retried, then dead-lettered as publish-failed. Dead letters
	// never go out with core NATS.
	CoreTargets bool `yaml:"core_targets"`
	TLS         TLS  `yaml:"tls"`
	// At most one of user/password, token and creds_file.
	User         string       `yaml:"user"`
	Password     Secret       `yaml:"password"`
	PasswordFile string       `yaml:"password_file"` // read by Load into Password
	Token        Secret       `yaml:"token"`
	TokenFile    string       `yaml:"token_file"` // read by Load into Token
	CredsFile    string       `yaml:"creds_file"` // a NATS .creds file, passed to the client
	Sources      []NATSSource `yaml:"sources"`    // at least one
}

// NATSSource is one delay subject (filter) of the stream.
type NATSSource struct {
	Subject string `yaml:"subject"`
	// DLQ is the dead-letter subject. Required, and no source subject may
	// match it: dead letters would be read back as delay messages.
	DLQ           string `yaml:"dlq"`
	DefaultTarget string `yaml:"default_target"`
}

// Targets restricts where publishers may send.
type Targets struct {
	// Allow lists glob patterns; see AllowTarget. Default ["*"] when the
	// targets block is omitted; empty (including a bare "allow:", and a
	// "targets:" block without allow) denies every target.
	Allow []string `yaml:"allow"`
}

// Admin is the admin HTTP server.
type Admin struct {
	Listen    string `yaml:"listen"` // default 127.0.0.1:8080
	Token     Secret `yaml:"token"`
	TokenFile string `yaml:"token_file"` // read by Load into Token
	// MetricsToken, with Token set, is a second bearer token that is good
	// for GET /metrics only: a scraper holding it cannot read or cancel
	// tasks. MetricsTokenFile is read by Load into it.
	MetricsToken     Secret `yaml:"metrics_token"`
	MetricsTokenFile string `yaml:"metrics_token_file"`
	// AllowInsecureListen permits a non-loopback listen without a token.
	AllowInsecureListen bool `yaml:"allow_insecure_listen"`
	// Pprof serves Go's runtime profiles under /debug/pprof/ (behind the
	// token when one is set). Default false.
	Pprof bool `yaml:"pprof"`
}

// Secret is a string that does not print: String, GoString, MarshalText and
// MarshalYAML return "REDACTED" when it is set, so a Config can be logged or
// dumped without leaking it. Use Value for the secret itself.
type Secret string

const redacted = "REDACTED"

// redactedMetrics stands for admin.metrics_token in the effective config
// (Config.String, run --check): validation refuses a metrics token equal
// to admin.token, so with both set that output would not load back if
// both read REDACTED (R225). A Secret holding it prints it as it is.
const redactedMetrics = "REDACTED-METRICS"

// Value returns the secret.
func (s Secret) Value() string { return string(s) }

func (s Secret) String() string {
	switch s {
	case "", redactedMetrics:
		return string(s)
	}
	return redacted
}

// GoString keeps %#v from printing the secret.
func (s Secret) GoString() string { return fmt.Sprintf("%q", s.String()) }

// MarshalText implements encoding.TextMarshaler with the redacted form.
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// MarshalYAML writes the redacted form.
func (s Secret) MarshalYAML() (any, error) { return s.String(), nil }

// Defaults. Exported so docs and the Helm chart can quote them.
const (
	DefaultShards   = 8
	DefaultHorizon  = 10 * time.Minute
	DefaultMaxDelay = 365 * 24 * time.Hour
	// DefaultMaxMessageBytes is 1 MiB less 1 KiB: a message at the limit,
	// delivered with its record framing, stays under Kafka's default
	// message.max.bytes (1048588).
	DefaultMaxMessageBytes = 1<<20 - 1024
	DefaultCancelRetention = 24 * time.Hour
	DefaultFireBatch       = 512
	DefaultFireBatchBytes  = 4 << 20
	DefaultStoreCacheMB    = 768
	DefaultStoreMemtableMB = 128
	DefaultShutdownTimeout = 10 * time.Second
	// DefaultCatchUpWait is the default catch_up_wait.
	DefaultCatchUpWait   = time.Minute
	DefaultAdminListen   = "127.0.0.1:8080"
	DefaultKafkaGroup    = "delaybridge"
	DefaultKafkaClientID = "delaybridge"
	DefaultNATSURL       = "nats://localhost:4222"
	DefaultNATSStream    = "DELAY"
	DefaultNATSConsumer  = "delaybridge"
)

// DefaultKafkaFetchMemoryMB is kafka.fetch_memory_mb's default (the Kafka
// adapter's DefaultFetchMemory).
const DefaultKafkaFetchMemoryMB = 32

// Default returns a Config holding every default and no transport.
func Default() *Config {
	return &Config{
		Shards:          DefaultShards,
		Horizon:         Duration(DefaultHorizon),
		MaxDelay:        Duration(DefaultMaxDelay),
		MaxMessageBytes: DefaultMaxMessageBytes,
		CancelRetention: Duration(DefaultCancelRetention),
		FireBatch:       DefaultFireBatch,
		FireBatchBytes:  DefaultFireBatchBytes,
		Store:           Store{CacheMB: DefaultStoreCacheMB, MemtableMB: DefaultStoreMemtableMB, ReserveMB: StoreReserveMB(DefaultStoreMemtableMB)},
		Retry: Retry{
			Initial:         Duration(500 * time.Millisecond),
			Max:             Duration(5 * time.Minute),
			Multiplier:      2,
			Jitter:          0.2,
			MaxAttempts:     10,
			WaitingInMemory: DefaultWaitingInMemory,
		},
		ShutdownTimeout: Duration(DefaultShutdownTimeout),
		CatchUpWait:     Duration(DefaultCatchUpWait),
		Log:             Log{Level: "info", Format: "json"},
		Targets:         Targets{Allow: []string{"*"}},
		Admin:           Admin{Listen: DefaultAdminListen},
	}
}

// fillBlockDefaults gives enabled transport blocks their defaults. Top-level
// defaults are in place before decoding (Default), so an explicit zero in
// YAML or the environment (jitter: 0) is kept; the blocks are allocated by
// the decoder, so their defaults are filled afterwards, and only for string
// keys whose empty value has no meaning.
func (c *Config) fillBlockDefaults() {
	if k := c.Kafka; k != nil {
		if k.Group == "" {
			k.Group = DefaultKafkaGroup
		}
		if k.ClientID == "" {
			k.ClientID = DefaultKafkaClientID
		}
	}
	if n := c.NATS; n != nil {
		if n.URL == "" {
			n.URL = DefaultNATSURL
		}
		if n.Stream == "" {
			n.Stream = DefaultNATSStream
		}
		if n.Consumer == "" {
			n.Consumer = DefaultNATSConsumer
		}
	}
}

// Load reads the YAML file at path, applies defaults and the DELAYBRIDGE_*
// variables of environ (os.Environ() form), reads the *_file secrets and
// validates the result. Every DELAYBRIDGE_ variable must name a key: a
// caller that uses other DELAYBRIDGE_ variables for itself must drop them
// from environ first.
func Load(path string, environ []string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	c, err := LoadBytes(data, environ)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}

// LoadBytes is Load on YAML held in memory.
func LoadBytes(data []byte, environ []string) (*Config, error) {
	c := Default()
	// YAML and environment problems are reported together.
	inYAML, nullInYAML, yamlErr := decodeYAML(data, c)
	fromEnv, envErr := applyEnv(c, environ)
	if err := errors.Join(yamlErr, envErr); err != nil {
		return nil, err
	}
	c.fillBlockDefaults()
	if _, env := fromEnv["store.memtable_mb"]; !env && !inYAML["store.memtable_mb"] {
		// The default memtable follows a smaller cache, so that cache_mb
		// alone is a valid config; a memtable_mb that is set is checked.
		c.Store.MemtableMB = min(DefaultStoreMemtableMB, c.Store.CacheMB/2)
	}
	if _, env := fromEnv["kafka.fetch_memory_mb"]; c.Kafka != nil && !env && !inYAML["kafka.fetch_memory_mb"] {
		// An int whose zero is refused: a default, not "set to 0".
		c.Kafka.FetchMemoryMB = DefaultKafkaFetchMemoryMB
	}
	if _, env := fromEnv["store.reserve_mb"]; !env && !inYAML["store.reserve_mb"] {
		// The default reserve follows the memtable: two write-ahead logs.
		c.Store.ReserveMB = StoreReserveMB(c.Store.MemtableMB)
	}
	v := &validator{fromEnv: fromEnv, nullInYAML: nullInYAML}
	c.readSecrets(v)
	if len(v.errs) == 0 {
		c.validate(v)
	}
	if err := errors.Join(v.errs...); err != nil {
		return nil, err
	}
	return c, nil
}

// readSecrets moves the contents of the *_file keys into their secrets. A
// key set both inline and by file is refused: which one wins would be a
// guess. Problems go to v.
func (c *Config) readSecrets(v *validator) {
	read := func(key string, file string, dst *Secret) {
		if file == "" {
			return
		}
		if *dst != "" {
			v.add(key+"_file", "conflicts with %s; set only one", v.name(key))
			return
		}
		b, err := os.ReadFile(file)
		if err != nil {
			v.add(key+"_file", "%w", err)
			return
		}
		s, err := parseSecret(b) // the one trailing newline of editors and "echo" dropped
		if err != nil {
			v.add(key+"_file", "%s is %w", file, err)
			return
		}
		*dst = Secret(s)
	}
	if k := c.Kafka; k != nil {
		read("kafka.sasl.password", k.SASL.PasswordFile, &k.SASL.Password)
	}
	if n := c.NATS; n != nil {
		read("nats.password", n.PasswordFile, &n.Password)
		read("nats.token", n.TokenFile, &n.Token)
	}
	read("admin.token", c.Admin.TokenFile, &c.Admin.Token)
	read("admin.metrics_token", c.Admin.MetricsTokenFile, &c.Admin.MetricsToken)
}

// Redacted returns a deep copy with every secret replaced by "REDACTED"
// (admin.metrics_token by "REDACTED-METRICS", see redactedMetrics).
func (c *Config) Redacted() *Config {
	r := *c
	r.Targets.Allow = append([]string(nil), c.Targets.Allow...)
	red := func(s Secret) Secret {
		if s == "" {
			return ""
		}
		return redacted
	}
	if c.Kafka != nil {
		k := *c.Kafka
		k.Brokers = append([]string(nil), k.Brokers...)
		k.Sources = append([]KafkaSource(nil), k.Sources...)
		k.SASL.Password = red(k.SASL.Password)
		r.Kafka = &k
	}
	if c.NATS != nil {
		n := *c.NATS
		n.Sources = append([]NATSSource(nil), n.Sources...)
		n.Password = red(n.Password)
		n.Token = red(n.Token)
		n.URL = redactURLs(n.URL)
		r.NATS = &n
	}
	r.Admin.Token = red(r.Admin.Token)
	if r.Admin.MetricsToken != "" {
		r.Admin.MetricsToken = redactedMetrics
	}
	return &r
}

// RedactURLs returns s, a comma-separated list of URLs as nats.url takes
// it, with the user information of each replaced by REDACTED: for errors
// and logs that name the URL.
func RedactURLs(s string) string { return redactURLs(s) }

// redactURLs replaces the user information of each comma-separated URL
// by REDACTED: the NATS client takes "nats://user:password@host" and
// "nats://token@host", so nats.url may hold a credential. A comma in a
// credential that is not percent-encoded (which Validate refuses) does not
// leave the part of it before the comma showing (urlSegments).
func redactURLs(s string) string {
	segs := urlSegments(s)
	for i, u := range segs {
		start := 0
		if j := strings.Index(u, "://"); j >= 0 {
			start = j + len("://")
		}
		// The last "@": a password may contain one unescaped, and
		// redacting too much is the safe side.
		if at := strings.LastIndex(u[start:], "@"); at >= 0 {
			segs[i] = u[:start] + redacted + u[start+at:]
		}
	}
	return strings.Join(segs, ",")
}

// urlSegments splits nats.url at its commas into URLs, except where a
// comma lies within a URL's user information: a part with no "@" (after
// its scheme, if it has one) followed by parts without a scheme, the last
// of them with an "@" ("nats://u:p,w@host", or "s3cr,3t@host", which the
// NATS client takes without a scheme), is one segment, commas included,
// which the NATS client would cut into pieces. Joined with "," the
// segments give s back.
func urlSegments(s string) []string {
	pieces := strings.Split(s, ",")
	segs := make([]string, 0, len(pieces))
	for i := 0; i < len(pieces); i++ {
		seg := pieces[i]
		j := strings.Index(seg, "://")
		if j < 0 {
			j = 0
		}
		if !strings.Contains(seg[j:], "@") {
			for k := i + 1; k < len(pieces) && !strings.Contains(pieces[k], "://"); k++ {
				if strings.Contains(pieces[k], "@") {
					seg = strings.Join(pieces[i:k+1], ",")
					i = k
					break
				}
			}
		}
		segs = append(segs, seg)
	}
	return segs
}

// String renders the configuration as YAML with secrets redacted,
// indented by two spaces as the README's reference is. A secret read from
// its *_file key is left out (the key names the file), so that the YAML
// loads back as a config (run --check > effective.yaml): with both the
// secret and its file it would conflict.
func (c Config) String() string {
	r := c.Redacted()
	if k := r.Kafka; k != nil && k.SASL.PasswordFile != "" {
		k.SASL.Password = ""
	}
	if n := r.NATS; n != nil {
		if n.PasswordFile != "" {
			n.Password = ""
		}
		if n.TokenFile != "" {
			n.Token = ""
		}
	}
	if r.Admin.TokenFile != "" {
		r.Admin.Token = ""
	}
	if r.Admin.MetricsTokenFile != "" {
		r.Admin.MetricsToken = ""
	}
	var b strings.Builder
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(r); err != nil {
		return "config: " + err.Error()
	}
	if err := enc.Close(); err != nil {
		return "config: " + err.Error()
	}
	return b.String()
}

// MarshalLogObject lets zap.Object("config", c) (and zap.Any) log the
// configuration with YAML key names and secrets redacted.
func (c *Config) MarshalLogObject(enc zapcore.ObjectEncoder) error {
	return logStruct(enc, reflect.ValueOf(c.Redacted()).Elem())
}

func logStruct(enc zapcore.ObjectEncoder, v reflect.Value) error {
	t := v.Type()
	for i := range t.NumField() {
		name := yamlName(t.Field(i))
		if name == "" {
			continue
		}
		if err := logValue(enc, name, v.Field(i)); err != nil {
			return err
		}
	}
	return nil
}

func logValue(enc zapcore.ObjectEncoder, key string, f reflect.Value) error {
	switch x := f.Interface().(type) {
	case Duration:
		enc.AddString(key, x.String())
		return nil
	case Secret:
		enc.AddString(key, x.String())
		return nil
	}
	switch f.Kind() {
	case reflect.String:
		enc.AddString(key, f.String())
	case reflect.Bool:
		enc.AddBool(key, f.Bool())
	case reflect.Int:
		enc.AddInt(key, int(f.Int()))
	case reflect.Float64:
		enc.AddFloat64(key, f.Float())
	case reflect.Pointer:
		if !f.IsNil() {
			return logValue(enc, key, f.Elem())
		}
	case reflect.Struct:
		return enc.AddObject(key, zapcore.ObjectMarshalerFunc(func(e zapcore.ObjectEncoder) error {
			return logStruct(e, f)
		}))
	case reflect.Slice:
		return enc.AddArray(key, zapcore.ArrayMarshalerFunc(func(a zapcore.ArrayEncoder) error {
			for j := range f.Len() {
				el := f.Index(j)
				if el.Kind() == reflect.Struct {
					if err := a.AppendObject(zapcore.ObjectMarshalerFunc(func(e zapcore.ObjectEncoder) error {
						return logStruct(e, el)
					})); err != nil {
						return err
					}
					continue
				}
				a.AppendString(fmt.Sprint(el.Interface()))
			}
			return nil
		}))
	}
	return nil
}
