package config

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"

	"github.com/delaybridge/delaybridge/codec"
)

// Validate checks the whole configuration and returns every problem at once
// (errors.Join), each naming its key path: "kafka.sources[0].dlq: required".
// It reads no secrets; it opens TLS and credentials files to check that they
// are readable.
func (c *Config) Validate() error {
	v := &validator{}
	c.validate(v)
	return errors.Join(v.errs...)
}

type validator struct {
	errs []error
	// fromEnv names the variable that set a key path, if one did.
	fromEnv map[string]string
	// nullInYAML holds the key paths the YAML gave a null value ("kafka:"
	// with nothing under it), which are as if omitted.
	nullInYAML map[string]bool
}

// add records a problem with key. The message names the environment
// variable that set the key, if one did: the operator will not find the
// value in the YAML file.
func (v *validator) add(key, format string, args ...any) {
	v.errs = append(v.errs, fmt.Errorf("%s: %w", v.name(key), fmt.Errorf(format, args...)))
}

// name is key, followed by the environment variable that set it (or set
// the list that the item "key[i]" is in), or else that added the list item
// the key is in: a key no variable set is then missing from an item an
// index in a variable's name made (kafka.sources[1] for
// DELAYBRIDGE_KAFKA_SOURCES_2_TOPIC when the file lists one source).
func (v *validator) name(key string) string {
	env, ok := v.fromEnv[key]
	if !ok && strings.HasSuffix(key, "]") {
		if i := strings.LastIndexByte(key, '['); i > 0 {
			env, ok = v.fromEnv[key[:i]]
		}
	}
	if ok {
		return key + " (from " + env + ")"
	}
	for i := strings.LastIndexByte(key, ']'); i > 0; i = strings.LastIndexByte(key[:i], ']') {
		if env, ok := v.fromEnv[key[:i+1]]; ok {
			return fmt.Sprintf("%s (in %s, a list item added by %s: items are numbered from 0, each with its own variables)", key, key[:i+1], env)
		}
	}
	return key
}

func (c *Config) validate(v *validator) {
	if strings.TrimSpace(c.DataDir) == "" {
		v.add("data_dir", "required")
	}
	if c.Shards < 1 || c.Shards > 1024 {
		v.add("shards", "must be between 1 and 1024, got %d", c.Shards)
	}
	if c.Horizon.Std() < time.Second {
		v.add("horizon", "must be at least 1s, got %s", c.Horizon)
	}
	if c.MaxDelay < 0 {
		v.add("max_delay", "must not be negative (0 means no bound), got %s", c.MaxDelay)
	}
	if c.MaxMessageBytes < 1 || c.MaxMessageBytes > maxMessageBytes {
		v.add("max_message_bytes", "must be between 1 and %d, got %d", maxMessageBytes, c.MaxMessageBytes)
	}
	if c.CancelRetention < 0 {
		v.add("cancel_retention", "must not be negative, got %s", c.CancelRetention)
	}
	if c.FireBatch < 1 || c.FireBatch > 1<<16 {
		v.add("fire_batch", "must be between 1 and 65536, got %d", c.FireBatch)
	}
	if c.FireBatchBytes < 1<<10 || c.FireBatchBytes > 1<<30 {
		v.add("fire_batch_bytes", "must be between 1024 and 1073741824, got %d", c.FireBatchBytes)
	}
	if c.Store.CacheMB < 64 || c.Store.CacheMB > 1<<20 {
		v.add("store.cache_mb", "must be between 64 and 1048576, got %d", c.Store.CacheMB)
	} else if c.Store.MemtableMB < 4 || c.Store.MemtableMB > c.Store.CacheMB/2 {
		v.add("store.memtable_mb", "must be between 4 and store.cache_mb/2 (%d), got %d", c.Store.CacheMB/2, c.Store.MemtableMB)
	}
	if c.Store.ReserveMB < 0 || c.Store.ReserveMB > 1<<24 {
		v.add("store.reserve_mb", "must be between 0 (no reserve) and 16777216, got %d", c.Store.ReserveMB)
	}
	c.Retry.validate(v)
	if c.ShutdownTimeout <= 0 {
		v.add("shutdown_timeout", "must be positive, got %s", c.ShutdownTimeout)
	}
	if c.CatchUpWait < 0 {
		v.add("catch_up_wait", "must not be negative (0: fire at once), got %s", c.CatchUpWait)
	}
	switch c.Log.Level {
	case "debug", "info", "warn", "error":
	default:
		v.add("log.level", "must be one of debug, info, warn, error; got %q", c.Log.Level)
	}
	switch c.Log.Format {
	case "json", "console":
	default:
		v.add("log.format", "must be json or console; got %q", c.Log.Format)
	}
	if c.Kafka == nil && c.NATS == nil {
		// A transport block with nothing under it reads as omitted; the
		// operator who wrote one meant that transport, so name it and what
		// it lacks rather than only that none is configured.
		empty := false
		if v.nullInYAML["kafka"] {
			empty = true
			v.add("kafka", "empty: nothing under \"kafka:\" (read as omitted), so no transport is configured; set kafka.brokers (at least one host:port) and kafka.sources (at least one delay topic, each with its dlq)")
		}
		if v.nullInYAML["nats"] {
			empty = true
			v.add("nats", "empty: nothing under \"nats:\" (read as omitted), so no transport is configured; set nats.sources (at least one delay subject, each with its dlq; nats.url defaults to %s)", DefaultNATSURL)
		}
		if !empty {
			v.add("kafka, nats", "at least one transport must be configured")
		}
	}
	if c.Kafka != nil {
		c.validateKafka(v, c.Kafka)
	}
	if c.NATS != nil {
		c.validateNATS(v, c.NATS)
	}
	if c.Kafka != nil && c.NATS != nil && c.NATS.Stream != "" {
		// Task ids are scoped to their source by its bare name (the
		// store, /v1/tasks/{source}/{id}): a delay topic and the stream of
		// one name would replace and cancel each other's tasks.
		for i, src := range c.Kafka.Sources {
			if src.Topic == c.NATS.Stream {
				v.add("nats.stream", "%q is also kafka.sources[%d].topic; task ids are scoped to their source by name, so a delay topic and the delay stream need different names", c.NATS.Stream, i)
			}
		}
	}
	for i, p := range c.Targets.Allow {
		if err := checkPattern(p); err != nil {
			v.add(fmt.Sprintf("targets.allow[%d]", i), "%v", err)
		}
	}
	checkBearerToken(v, "admin.token", c.Admin.Token.Value(), c.Admin.TokenFile)
	if mt := c.Admin.MetricsToken.Value(); mt != "" {
		checkBearerToken(v, "admin.metrics_token", mt, c.Admin.MetricsTokenFile)
		switch {
		case c.Admin.Token == "":
			v.add("admin.metrics_token", "needs admin.token (without it /metrics is open to anyone who can reach admin.listen)")
		case mt == c.Admin.Token.Value():
			v.add("admin.metrics_token", "must differ from admin.token: it is the token good for /metrics only")
		}
	}
	if c.Admin.Listen == "" {
		v.add("admin.listen", "required")
	} else if err := listenProblem(c.Admin.Listen, c.Admin.Token.Value(), c.Admin.AllowInsecureListen); err != nil {
		v.add("admin.listen", "%w", err)
	}
}

// maxMessageBytes bounds max_message_bytes: 1 GiB, within Kafka's int32
// sizes, and far from the overflow of the Kafka producer's batch bound
// (max_message_bytes plus the dead-letter headers, bridge/service).
const maxMessageBytes = 1 << 30

// maxRetryWait bounds retry.max: a publish retried less than once a year
// is a slip of the unit, not a policy.
const maxRetryWait = Duration(365 * 24 * time.Hour)

func (r *Retry) validate(v *validator) {
	if r.Initial <= 0 {
		v.add("retry.initial", "must be positive, got %s", r.Initial)
	}
	if r.Max < r.Initial {
		v.add("retry.max", "must be at least retry.initial (%s), got %s", r.Initial, r.Max)
	}
	if r.Max > maxRetryWait {
		v.add("retry.max", "must be at most 365d, got %s", r.Max)
	}
	if !(r.Multiplier >= 1) { // also catches NaN
		v.add("retry.multiplier", "must be at least 1, got %g", r.Multiplier)
	}
	if !(r.Jitter >= 0 && r.Jitter < 1) {
		v.add("retry.jitter", "must be in [0, 1), got %g", r.Jitter)
	}
	if r.MaxAttempts < 1 {
		v.add("retry.max_attempts", "must be at least 1, got %d", r.MaxAttempts)
	}
	if r.WaitingInMemory < 0 {
		v.add("retry.waiting_in_memory", "must be at least 0, got %d", r.WaitingInMemory)
	}
}

// maxKafkaFetchMemoryMB bounds kafka.fetch_memory_mb: 64 GiB, far past any
// pod, and far from overflowing its bytes.
const maxKafkaFetchMemoryMB = 1 << 16

// SASL mechanisms the Kafka adapter supports.
var saslMechanisms = []string{"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}

func (c *Config) validateKafka(v *validator, k *Kafka) {
	if len(k.Brokers) == 0 {
		v.add("kafka.brokers", "required: at least one host:port")
	}
	for i, b := range k.Brokers {
		if err := checkHostPort(b, false); err != nil {
			v.add(fmt.Sprintf("kafka.brokers[%d]", i), "%v", err)
		}
	}
	if k.Group == "" {
		v.add("kafka.group", "required")
	}
	validateTLS(v, "kafka.tls", &k.TLS)
	s := &k.SASL
	switch {
	case s.Mechanism == "":
		if s.Username != "" || s.Password != "" || s.PasswordFile != "" {
			v.add("kafka.sasl.mechanism", "required when kafka.sasl credentials are set (one of %s)", strings.Join(saslMechanisms, ", "))
		}
	case !slices.ContainsFunc(saslMechanisms, func(m string) bool { return strings.EqualFold(m, s.Mechanism) }):
		v.add("kafka.sasl.mechanism", "must be one of %s; got %q", strings.Join(saslMechanisms, ", "), s.Mechanism)
	default:
		if s.Username == "" {
			v.add("kafka.sasl.username", "required with mechanism %s", s.Mechanism)
		}
		if s.Password == "" && s.PasswordFile == "" {
			v.add("kafka.sasl.password", "required with mechanism %s (or kafka.sasl.password_file)", s.Mechanism)
		}
	}
	if k.FetchMemoryMB < 1 || k.FetchMemoryMB > maxKafkaFetchMemoryMB {
		v.add("kafka.fetch_memory_mb", "must be between 1 and %d (MiB), got %d", maxKafkaFetchMemoryMB, k.FetchMemoryMB)
	}
	if len(k.Sources) == 0 {
		v.add("kafka.sources", "required: at least one delay topic")
	}
	topics := map[string]string{}
	for i, src := range k.Sources {
		key := fmt.Sprintf("kafka.sources[%d]", i)
		if src.Topic == "" {
			v.add(key+".topic", "required")
		} else if err := checkKafkaTopic(src.Topic); err != nil {
			v.add(key+".topic", "%v", err)
		} else if prev, dup := topics[src.Topic]; dup {
			v.add(key+".topic", "%q is already %s", src.Topic, prev)
		} else {
			topics[src.Topic] = key + ".topic"
		}
		if src.DLQ == "" {
			v.add(key+".dlq", "required")
		} else if err := checkKafkaTopic(src.DLQ); err != nil {
			v.add(key+".dlq", "%v", err)
		}
		c.checkDefaultTarget(v, key+".default_target", src.DefaultTarget, codec.TransportKafka)
	}
	// A DLQ that is also a delay topic would read dead letters back in.
	for i, src := range k.Sources {
		if prev, ok := topics[src.DLQ]; ok {
			v.add(fmt.Sprintf("kafka.sources[%d].dlq", i), "%q is a delay topic (%s): dead letters would loop", src.DLQ, prev)
		}
	}
}

func (c *Config) validateNATS(v *validator, n *NATS) {
	var urls []string
	urlCreds := false // a URL with user information: its credentials
	if n.URL == "" {
		v.add("nats.url", "required")
	} else {
		for _, seg := range urlSegments(n.URL) {
			if strings.Contains(seg, ",") {
				// The client splits nats.url at every comma: this URL
				// would be cut inside its credential, and each piece
				// reported (and shown) on its own.
				v.add("nats.url", "%q: a \",\" in the token or password splits the URL (nats.url is a comma-separated list); percent-encode it (%%2C)", redactURLs(seg))
				urlCreds = true
				continue
			}
			urls = append(urls, seg)
		}
	}
	for _, u := range urls {
		u = strings.TrimSpace(u)
		p, err := url.Parse(u)
		if strings.Contains(u, "@") && (err != nil || p.User == nil || strings.Contains(p.Host+p.Path+p.RawQuery+p.Fragment+p.Opaque, "@")) {
			// A "/", "?" or "#" in a token or password ends the user
			// information early: the credential would be taken for a host
			// name (or not parse) and show in every connection error.
			v.add("nats.url", "%q: a \"/\", \"?\", \"#\" or \"%%\" in the token or password ends the URL's user information or does not parse; percent-encode them (%%2F, %%3F, %%23, %%25)", redactURLs(u))
			continue
		}
		if err != nil || p.Host == "" {
			v.add("nats.url", "%q is not a URL like nats://host:4222", redactURLs(u))
			continue
		}
		urlCreds = urlCreds || p.User != nil
		switch p.Scheme {
		case "nats", "tls", "ws", "wss":
		default:
			v.add("nats.url", "%q: scheme must be nats, tls, ws or wss", redactURLs(u))
		}
	}
	if n.Stream == "" {
		v.add("nats.stream", "required")
	} else if err := checkNATSName(n.Stream); err != nil {
		v.add("nats.stream", "%v", err)
	}
	if n.Consumer == "" {
		v.add("nats.consumer", "required")
	} else if err := checkNATSName(n.Consumer); err != nil {
		v.add("nats.consumer", "%v", err)
	}
	switch {
	case n.Replicas < 0 || n.Replicas > 5:
		v.add("nats.replicas", "%d: JetStream takes 1 to 5", n.Replicas)
	case n.Replicas > 0 && !n.Create:
		v.add("nats.replicas", "the bridge sets the stream's replicas only with nats.create: true; without it, set them on the stream (nats stream edit --replicas)")
	}
	validateTLS(v, "nats.tls", &n.TLS)
	hasPass := n.Password != "" || n.PasswordFile != ""
	hasToken := n.Token != "" || n.TokenFile != ""
	methods := 0
	for _, b := range []bool{n.User != "" || hasPass, hasToken, n.CredsFile != ""} {
		if b {
			methods++
		}
	}
	if methods > 1 {
		v.add("nats", "set only one of user/password, token and creds_file")
	}
	if urlCreds && methods > 0 {
		// The client takes the URL's and ignores the others, or, with a
		// *_file (asked at each connect), refuses to connect.
		v.add("nats.url", "holds credentials, and so do nats.user/password, token or creds_file; set them in one place")
	}
	if n.User != "" && !hasPass {
		v.add("nats.password", "required with nats.user (or nats.password_file)")
	}
	if n.User == "" && hasPass {
		v.add("nats.user", "required with nats.password")
	}
	if checkReadable(v, "nats.creds_file", n.CredsFile) {
		checkCreds(v, "nats.creds_file", n.CredsFile)
	}
	if len(n.Sources) == 0 {
		v.add("nats.sources", "required: at least one delay subject")
	}
	subjects := map[string]bool{}
	for i, src := range n.Sources {
		key := fmt.Sprintf("nats.sources[%d]", i)
		if src.Subject == "" {
			v.add(key+".subject", "required")
		} else if err := checkSubject(src.Subject, true); err != nil {
			v.add(key+".subject", "%v", err)
		} else if subjects[src.Subject] {
			v.add(key+".subject", "%q is listed twice", src.Subject)
		} else {
			subjects[src.Subject] = true
			// JetStream refuses overlapping filter subjects on one
			// consumer, and a message must belong to one source.
			for j := range i {
				other := n.Sources[j].Subject
				if other != src.Subject && checkSubject(other, true) == nil && subjectsOverlap(other, src.Subject) {
					v.add(key+".subject", "%q overlaps nats.sources[%d].subject %q", src.Subject, j, other)
				}
			}
		}
		if src.DLQ == "" {
			v.add(key+".dlq", "required")
		} else if err := checkSubject(src.DLQ, false); err != nil {
			v.add(key+".dlq", "%v", err)
		} else {
			for j, other := range n.Sources {
				if checkSubject(other.Subject, true) == nil && SubjectMatches(other.Subject, src.DLQ) {
					v.add(key+".dlq", "%q is matched by nats.sources[%d].subject %q: dead letters would loop", src.DLQ, j, other.Subject)
				}
			}
		}
		c.checkDefaultTarget(v, key+".default_target", src.DefaultTarget, codec.TransportNATS)
	}
}

// checkDefaultTarget checks a source's default target with the parser the
// codec applies to it at run time (codec.ParseTarget), that a transport it
// crosses to is configured, and that targets.allow lets it through:
// otherwise every message without delay-target would be dead-lettered.
func (c *Config) checkDefaultTarget(v *validator, key, target string, own codec.Transport) {
	if target == "" {
		return
	}
	t, name, err := codec.ParseTarget(target, own)
	if err != nil {
		v.add(key, "%v", err)
		return
	}
	if !c.HasTransport(t) {
		v.add(key, "%q names %s, which is not configured", target, t)
		return
	}
	if c.DelaySource(t, name) {
		v.add(key, "%q is a delay source of this bridge: its deliveries would come back as missing-due dead letters", target)
		return
	}
	if !c.AllowTarget(t, name) {
		v.add(key, "%q is not allowed by targets.allow", target)
	}
}

func validateTLS(v *validator, key string, t *TLS) {
	files := []struct{ name, path string }{
		{"ca_file", t.CAFile}, {"cert_file", t.CertFile}, {"key_file", t.KeyFile},
	}
	if !t.Enabled {
		for _, f := range files {
			if f.path != "" {
				v.add(key+"."+f.name, "set but %s.enabled is false", key)
			}
		}
		return
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		v.add(key, "cert_file and key_file go together")
	}
	readable := map[string]bool{}
	for _, f := range files {
		readable[f.name] = checkReadable(v, key+"."+f.name, f.path)
	}
	// What the start loads (Build), so run --check refuses what the start
	// would: a CA file without a certificate (read even with
	// insecure_skip_verify), a certificate and key that are no pair.
	if t.CAFile != "" && readable["ca_file"] {
		if _, err := readCAs(t.CAFile); err != nil {
			v.add(key+".ca_file", "%v", err)
		}
	}
	if t.CertFile != "" && t.KeyFile != "" && readable["cert_file"] && readable["key_file"] {
		if _, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile); err != nil {
			v.add(key+".cert_file", "with %s.key_file: %v", key, err)
		}
	}
}

// checkReadable reports whether path is empty or names a readable file;
// a problem goes to v.
func checkReadable(v *validator, key, path string) bool {
	if path == "" {
		return true
	}
	f, err := os.Open(path)
	if err != nil {
		v.add(key, "not readable: %v", err)
		return false
	}
	defer f.Close()
	if st, err := f.Stat(); err == nil && st.IsDir() {
		v.add(key, "%s is a directory", path)
		return false
	}
	return true
}

// checkCreds checks that the file at path (readable, or empty: none) is a
// NATS .creds file as the client reads it at each connect: a user JWT and
// its nkey seed. Without this a wrong file passed --check and the start
// failed at the first connect with an error naming the file, not the key.
func checkCreds(v *validator, key, path string) {
	if path == "" {
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		v.add(key, "not readable: %v", err)
		return
	}
	defer clear(b) // it holds the seed
	problem := func(err error) {
		v.add(key, "%s is not a NATS .creds file (a user JWT and its nkey seed): %v", path, err)
	}
	kp, err := nkeys.ParseDecoratedNKey(b)
	if err != nil {
		problem(err)
		return
	}
	kp.Wipe() // its copy of the seed (nats.go reads the file again to connect)
	tok, err := nkeys.ParseDecoratedJWT(b)
	if err == nil {
		_, err = jwt.DecodeGeneric(tok)
	}
	if err != nil {
		problem(fmt.Errorf("no user JWT: %w", err))
	}
}

// checkBearerToken refuses a token that no Authorization header can carry:
// HTTP drops the white space around a header value (and the admin server
// trims what is left) and forbids control characters, so every request
// would be answered 401.
func checkBearerToken(v *validator, key, tok, file string) {
	from := ""
	if file != "" {
		from = fmt.Sprintf(" (read from %s_file %s)", key, file)
	}
	if strings.TrimSpace(tok) != tok {
		v.add(key, "must not begin or end with white space%s", from)
	}
	if strings.ContainsFunc(tok, unicode.IsControl) {
		v.add(key, "must not hold control characters%s", from)
	}
}

// checkHostPort checks "host:port"; listen (a listen address) allows an
// empty host and port 0 (any free port), which name no server to dial.
func checkHostPort(s string, listen bool) error {
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		return fmt.Errorf("%q is not host:port", s)
	}
	if host == "" && !listen {
		return fmt.Errorf("%q has no host", s)
	}
	lo := 1
	if listen {
		lo = 0
	}
	// Digits only: Atoi would also take "+80".
	p, err := strconv.Atoi(port)
	if err != nil || strings.TrimLeft(port, "0123456789") != "" || p < lo || p > 65535 {
		return fmt.Errorf("%q: port must be a number %d..65535", s, lo)
	}
	return nil
}

// checkKafkaTopic applies Kafka's topic name rules: 1..249 characters of
// [a-zA-Z0-9._-], not "." or "..".
func checkKafkaTopic(s string) error {
	if s == "" {
		return errors.New("empty topic name")
	}
	if len(s) > 249 {
		return fmt.Errorf("topic %q is longer than 249 characters", s[:32]+"...")
	}
	if s == "." || s == ".." {
		return fmt.Errorf("topic %q is not allowed", s)
	}
	for _, r := range s {
		if !(r < unicode.MaxASCII && (r == '.' || r == '_' || r == '-' || unicode.IsLetter(r) || unicode.IsDigit(r))) {
			return fmt.Errorf("topic %q: only letters, digits, '.', '_' and '-' are allowed", s)
		}
	}
	return nil
}

// checkNATSName checks a stream or consumer name: no white space, dots,
// wildcards or path separators.
func checkNATSName(s string) error {
	if strings.ContainsAny(s, " \t\r\n.*>/\\") {
		return fmt.Errorf("%q: may not contain white space, '.', '*', '>', '/' or '\\'", s)
	}
	if len(s) > 255 {
		return fmt.Errorf("%q... is longer than 255 characters", s[:32])
	}
	return nil
}

// checkSubject checks a NATS subject: dot-separated non-empty tokens without
// white space; with wildcards, "*" is a whole token and ">" the whole last one.
func checkSubject(s string, wildcards bool) error {
	if s == "" {
		return errors.New("empty subject")
	}
	if len(s) > codec.MaxSubjectLen {
		return fmt.Errorf("subject %q... is longer than %d bytes", s[:32], codec.MaxSubjectLen)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c == 0x7f {
			return fmt.Errorf("subject %q contains white space or a control character", s)
		}
	}
	toks := strings.Split(s, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return fmt.Errorf("subject %q has an empty token", s)
		case t == "*" || t == ">":
			if !wildcards {
				return fmt.Errorf("subject %q: wildcards are not allowed here", s)
			}
			if t == ">" && i != len(toks)-1 {
				return fmt.Errorf("subject %q: '>' must be the last token", s)
			}
		case strings.ContainsAny(t, "*>"):
			return fmt.Errorf("subject %q: '*' and '>' must be whole tokens", s)
		}
	}
	return nil
}

// SubjectMatches reports whether the NATS subject filter (with "*" and ">"
// wildcards) matches the literal subject.
// It allocates nothing: the service asks it for every NATS target parsed
// (DelaySource).
func SubjectMatches(filter, subject string) bool {
	done := false // the subject has no token left
	for {
		ft, frest, fmore := strings.Cut(filter, ".")
		if ft == ">" {
			return !done
		}
		if done {
			return false
		}
		st, srest, smore := strings.Cut(subject, ".")
		if ft != "*" && ft != st {
			return false
		}
		if !fmore {
			return !smore
		}
		filter, subject, done = frest, srest, !smore
	}
}

// subjectsOverlap reports whether some subject matches both filters.
func subjectsOverlap(a, b string) bool {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; ; i++ {
		aEnd, bEnd := i >= len(at), i >= len(bt)
		switch {
		case aEnd || bEnd:
			return aEnd && bEnd
		case at[i] == ">" || bt[i] == ">":
			return true
		case at[i] != "*" && bt[i] != "*" && at[i] != bt[i]:
			return false
		}
	}
}

// CheckListen refuses an admin listen address that is reachable from other
// hosts (an empty or unspecified host, a non-loopback IP, any host name
// other than "localhost") when token is empty, unless allowInsecure. The
// admin API can cancel tasks, so exposing it unauthenticated must be a
// deliberate choice.
func CheckListen(listen, token string, allowInsecure bool) error {
	if err := listenProblem(listen, token, allowInsecure); err != nil {
		return fmt.Errorf("admin.listen: %w", err)
	}
	return nil
}

// listenProblem is CheckListen's problem without the key, for Validate,
// which names the key (and the environment variable a value came from).
func listenProblem(listen, token string, allowInsecure bool) error {
	if err := checkHostPort(listen, true); err != nil {
		return err
	}
	if token != "" || allowInsecure || isLoopback(listen) {
		return nil
	}
	return fmt.Errorf("%q is reachable from other hosts and admin.token is empty: set admin.token (or admin.token_file), listen on 127.0.0.1, or set admin.allow_insecure_listen: true", listen)
}

func isLoopback(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
