package config

import (
	"crypto/x509"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/internal/testcert"
)

func TestValidate(t *testing.T) {
	dir := t.TempDir()
	readable := filepath.Join(dir, "ok.pem")
	if err := os.WriteFile(readable, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")
	creds, seedOnly := credsFiles(t, dir)
	caPEM, certPEM, keyPEM, otherKeyPEM := tlsFiles(t, dir)

	tests := []struct {
		name   string
		mutate func(c *Config)
		want   string // "" = valid; else a substring naming the key
	}{
		{"valid", func(c *Config) {}, ""},
		{"data_dir required", func(c *Config) { c.DataDir = "" }, "data_dir: required"},
		{"shards zero", func(c *Config) { c.Shards = 0 }, "shards: must be between 1 and 1024"},
		{"shards too many", func(c *Config) { c.Shards = 1025 }, "shards: must be between 1 and 1024"},
		{"shards max ok", func(c *Config) { c.Shards = 1024 }, ""},
		{"horizon short", func(c *Config) { c.Horizon = Duration(999 * time.Millisecond) }, "horizon: must be at least 1s"},
		{"max_delay negative", func(c *Config) { c.MaxDelay = -1 }, "max_delay: must not be negative"},
		{"max_delay zero ok", func(c *Config) { c.MaxDelay = 0 }, ""},
		{"max_message_bytes", func(c *Config) { c.MaxMessageBytes = 0 }, "max_message_bytes: must be between 1 and 1073741824, got 0"},
		{"max_message_bytes max ok", func(c *Config) { c.MaxMessageBytes = 1 << 30 }, ""},
		// Beyond what a broker takes (Kafka sizes are int32), and near
		// MaxInt the Kafka producer's batch bound (max_message_bytes plus
		// the dead-letter headers) overflowed to its 1 MiB floor.
		{"max_message_bytes high", func(c *Config) { c.MaxMessageBytes = math.MaxInt }, "max_message_bytes: must be between 1 and 1073741824"},
		{"cancel_retention", func(c *Config) { c.CancelRetention = -1 }, "cancel_retention: must not be negative"},
		{"fire_batch", func(c *Config) { c.FireBatch = 0 }, "fire_batch: must be between"},
		{"fire_batch_bytes low", func(c *Config) { c.FireBatchBytes = 1023 }, "fire_batch_bytes: must be between 1024"},
		{"fire_batch_bytes high", func(c *Config) { c.FireBatchBytes = 1<<30 + 1 }, "fire_batch_bytes: must be between"},
		{"store cache too small", func(c *Config) { c.Store.CacheMB = 32 }, "store.cache_mb: must be between 64"},
		{"store memtable over half the cache", func(c *Config) { c.Store.MemtableMB = 512 }, "store.memtable_mb: must be between 4 and store.cache_mb/2 (384), got 512"},
		{"store memtable zero", func(c *Config) { c.Store.MemtableMB = 0 }, "store.memtable_mb: must be between"},
		{"retry.initial", func(c *Config) { c.Retry.Initial = 0 }, "retry.initial: must be positive"},
		{"retry.max below initial", func(c *Config) { c.Retry.Max = Duration(time.Millisecond) }, "retry.max: must be at least retry.initial"},
		{"retry.max above a year", func(c *Config) { c.Retry.Max = Duration(366 * 24 * time.Hour) }, "retry.max: must be at most 365d"},
		{"retry.max a year ok", func(c *Config) { c.Retry.Max = Duration(365 * 24 * time.Hour) }, ""},
		{"retry.multiplier", func(c *Config) { c.Retry.Multiplier = 0.5 }, "retry.multiplier: must be at least 1"},
		{"retry.multiplier NaN", func(c *Config) { c.Retry.Multiplier = math.NaN() }, "retry.multiplier"},
		{"retry.multiplier 1 ok", func(c *Config) { c.Retry.Multiplier = 1 }, ""},
		{"retry.jitter negative", func(c *Config) { c.Retry.Jitter = -0.1 }, "retry.jitter: must be in [0, 1)"},
		{"retry.jitter one", func(c *Config) { c.Retry.Jitter = 1 }, "retry.jitter: must be in [0, 1)"},
		{"retry.jitter zero ok", func(c *Config) { c.Retry.Jitter = 0 }, ""},
		{"retry.max_attempts", func(c *Config) { c.Retry.MaxAttempts = 0 }, "retry.max_attempts: must be at least 1"},
		{"retry.waiting_in_memory", func(c *Config) { c.Retry.WaitingInMemory = -1 }, "retry.waiting_in_memory: must be at least 0"},
		{"retry.waiting_in_memory zero ok", func(c *Config) { c.Retry.WaitingInMemory = 0 }, ""},
		{"shutdown_timeout", func(c *Config) { c.ShutdownTimeout = 0 }, "shutdown_timeout: must be positive"},
		{"catch_up_wait", func(c *Config) { c.CatchUpWait = Duration(-time.Second) }, "catch_up_wait: must not be negative"},
		{"catch_up_wait zero ok", func(c *Config) { c.CatchUpWait = 0 }, ""},
		{"log.level", func(c *Config) { c.Log.Level = "loud" }, `log.level: must be one of debug, info, warn, error; got "loud"`},
		{"log.format", func(c *Config) { c.Log.Format = "xml" }, "log.format: must be json or console"},
		{"no transport", func(c *Config) { c.Kafka, c.NATS = nil, nil }, "kafka, nats: at least one transport"},
		{"kafka only ok", func(c *Config) { c.NATS = nil }, ""},
		{"nats only ok", func(c *Config) { c.Kafka = nil }, ""},

		// kafka
		{"kafka.brokers required", func(c *Config) { c.Kafka.Brokers = nil }, "kafka.brokers: required"},
		{"kafka.brokers host:port", func(c *Config) { c.Kafka.Brokers = []string{"a:1", "nohost"} }, `kafka.brokers[1]: "nohost" is not host:port`},
		{"kafka.brokers port", func(c *Config) { c.Kafka.Brokers = []string{"a:http"} }, "kafka.brokers[0]: \"a:http\": port must be"},
		{"kafka.brokers empty host", func(c *Config) { c.Kafka.Brokers = []string{":9092"} }, "kafka.brokers[0]: \":9092\" has no host"},
		{"kafka.brokers port 0", func(c *Config) { c.Kafka.Brokers = []string{"a:0"} }, "kafka.brokers[0]: \"a:0\": port must be a number 1..65535"},
		{"kafka.brokers signed port", func(c *Config) { c.Kafka.Brokers = []string{"a:+9092"} }, "kafka.brokers[0]: \"a:+9092\": port must be a number 1..65535"},
		{"admin.listen port 0 ok", func(c *Config) { c.Admin.Listen = "127.0.0.1:0" }, ""},
		{"kafka.group required", func(c *Config) { c.Kafka.Group = "" }, "kafka.group: required"},
		{"kafka.sources required", func(c *Config) { c.Kafka.Sources = nil }, "kafka.sources: required"},
		{"kafka topic required", func(c *Config) { c.Kafka.Sources[0].Topic = "" }, "kafka.sources[0].topic: required"},
		{"kafka topic chars", func(c *Config) { c.Kafka.Sources[0].Topic = "de lay" }, "kafka.sources[0].topic: topic \"de lay\": only letters"},
		{"kafka topic non-ascii", func(c *Config) { c.Kafka.Sources[0].Topic = "délai" }, "kafka.sources[0].topic: topic"},
		{"kafka topic dot", func(c *Config) { c.Kafka.Sources[0].Topic = ".." }, "kafka.sources[0].topic: topic \"..\" is not allowed"},
		{"kafka topic long", func(c *Config) { c.Kafka.Sources[0].Topic = strings.Repeat("a", 250) }, "kafka.sources[0].topic: topic"},
		{"kafka topic 249 ok", func(c *Config) { c.Kafka.Sources[0].Topic = strings.Repeat("a", 249) }, ""},
		{"kafka topic dup", func(c *Config) {
			c.Kafka.Sources = append(c.Kafka.Sources, KafkaSource{Topic: "delay", DLQ: "x"})
		}, `kafka.sources[1].topic: "delay" is already kafka.sources[0].topic`},
		{"kafka dlq required", func(c *Config) { c.Kafka.Sources[0].DLQ = "" }, "kafka.sources[0].dlq: required"},
		{"kafka dlq legal", func(c *Config) { c.Kafka.Sources[0].DLQ = "a/b" }, "kafka.sources[0].dlq: topic"},
		{"kafka dlq loops", func(c *Config) { c.Kafka.Sources[0].DLQ = "delay" }, "kafka.sources[0].dlq: \"delay\" is a delay topic"},
		{"kafka default target ok", func(c *Config) { c.Kafka.Sources[0].DefaultTarget = "orders" }, ""},
		{"kafka default target cross ok", func(c *Config) { c.Kafka.Sources[0].DefaultTarget = "nats:orders.x" }, ""},
		{"kafka default target bad", func(c *Config) { c.Kafka.Sources[0].DefaultTarget = "or ders" }, `kafka.sources[0].default_target: codec: target "or ders": illegal character ' ' in a Kafka topic`},
		{"kafka default target unconfigured transport", func(c *Config) {
			c.NATS = nil
			c.Kafka.Sources[0].DefaultTarget = "nats:x"
		}, `kafka.sources[0].default_target: "nats:x" names nats, which is not configured`},
		{"kafka default target not allowed", func(c *Config) {
			c.Targets.Allow = []string{"nats:*"}
			c.Kafka.Sources[0].DefaultTarget = "orders"
		}, `kafka.sources[0].default_target: "orders" is not allowed by targets.allow`},
		{"sasl mechanism set", func(c *Config) { c.Kafka.SASL.Mechanism = "GSSAPI" }, `kafka.sasl.mechanism: must be one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512; got "GSSAPI"`},
		{"sasl username needs mechanism", func(c *Config) { c.Kafka.SASL.Username = "u" }, "kafka.sasl.mechanism: required when"},
		{"sasl password required", func(c *Config) { c.Kafka.SASL = SASL{Mechanism: "PLAIN", Username: "u"} }, "kafka.sasl.password: required with mechanism PLAIN"},
		{"sasl username required", func(c *Config) { c.Kafka.SASL = SASL{Mechanism: "SCRAM-SHA-256", Password: "p"} }, "kafka.sasl.username: required"},
		{"sasl ok", func(c *Config) { c.Kafka.SASL = SASL{Mechanism: "SCRAM-SHA-512", Username: "u", Password: "p"} }, ""},
		{"sasl mechanism in lower case ok", func(c *Config) { c.Kafka.SASL = SASL{Mechanism: "plain", Username: "u", Password: "p"} }, ""},
		{"tls file unreadable", func(c *Config) { c.Kafka.TLS = TLS{Enabled: true, CAFile: missing} }, "kafka.tls.ca_file: not readable"},
		{"tls file is dir", func(c *Config) { c.Kafka.TLS = TLS{Enabled: true, CAFile: dir} }, "kafka.tls.ca_file: " + dir + " is a directory"},
		{"tls cert without key", func(c *Config) { c.Kafka.TLS = TLS{Enabled: true, CertFile: readable} }, "kafka.tls: cert_file and key_file go together"},
		{"tls key unreadable", func(c *Config) { c.NATS.TLS = TLS{Enabled: true, CertFile: readable, KeyFile: missing} }, "nats.tls.key_file: not readable"},
		{"tls files while disabled", func(c *Config) { c.NATS.TLS = TLS{CAFile: readable} }, "nats.tls.ca_file: set but nats.tls.enabled is false"},
		{"tls ok", func(c *Config) {
			c.Kafka.TLS = TLS{Enabled: true, CAFile: caPEM, CertFile: certPEM, KeyFile: keyPEM}
		}, ""},
		// Files that the start cannot use (it fails naming kafka.tls)
		// failed run --check too.
		{"tls ca not PEM", func(c *Config) { c.Kafka.TLS = TLS{Enabled: true, CAFile: readable} }, "kafka.tls.ca_file: tls ca file " + readable + ": no PEM certificate found"},
		{"tls ca not PEM, verification off", func(c *Config) { c.Kafka.TLS = TLS{Enabled: true, CAFile: readable, InsecureSkipVerify: true} }, "kafka.tls.ca_file: tls ca file"},
		{"tls key pair not PEM", func(c *Config) { c.NATS.TLS = TLS{Enabled: true, CertFile: readable, KeyFile: readable} }, "nats.tls.cert_file: with nats.tls.key_file: tls: failed to find any PEM data in certificate input"},
		{"tls key of another certificate", func(c *Config) { c.NATS.TLS = TLS{Enabled: true, CertFile: certPEM, KeyFile: otherKeyPEM} }, "nats.tls.cert_file: with nats.tls.key_file: tls: private key does not match public key"},

		// nats
		{"nats.url required", func(c *Config) { c.NATS.URL = "" }, "nats.url: required"},
		{"nats.url scheme", func(c *Config) { c.NATS.URL = "http://x:4222" }, "nats.url: \"http://x:4222\": scheme must be"},
		{"nats.url garbage", func(c *Config) { c.NATS.URL = "nats://a:1, ::" }, "nats.url: \"::\" is not a URL"},
		{"nats.url list ok", func(c *Config) { c.NATS.URL = "nats://a:1, tls://b:2" }, ""},
		{"nats.url credential ok", func(c *Config) { c.NATS.URL = "nats://u:p%2Fw@a:1,nats://tok%3Fen@b:2" }, ""},
		{"nats.url credential and token", func(c *Config) { c.NATS.URL = "nats://tok@a:1"; c.NATS.Token = "t" },
			"nats.url: holds credentials, and so do nats.user/password, token or creds_file; set them in one place"},
		{"nats.url credential and user", func(c *Config) { c.NATS.URL = "nats://a:1,nats://u:p@b:2"; c.NATS.User, c.NATS.Password = "u", "p" },
			"nats.url: holds credentials"},
		{"nats.url unescaped / in token", func(c *Config) { c.NATS.URL = "nats://c2VjcmV0/dG9rZW4=@a:1" },
			`nats.url: "nats://REDACTED@a:1": a "/", "?", "#" or "%" in the token or password ends the URL's user information or does not parse; percent-encode them`},
		{"nats.url unescaped @ and / in token", func(c *Config) { c.NATS.URL = "nats://tok@en/x@b:2" },
			`nats.url: "nats://REDACTED@b:2": a "/", "?", "#" or "%"`},
		{"nats.url unescaped ? in password", func(c *Config) { c.NATS.URL = "nats://a:1,nats://u:p?w@b:2" },
			`nats.url: "nats://REDACTED@b:2": a "/", "?", "#" or "%"`},
		// A comma in a password splits nats.url, a comma-separated list:
		// the error named the pieces, the first of them (scheme, user and
		// the password up to the comma) unredacted.
		{"nats.url unescaped , in password", func(c *Config) { c.NATS.URL = "nats://a:1,nats://u:s3cr3t,pw@b:2" },
			`nats.url: "nats://REDACTED@b:2": a "," in the token or password splits the URL (nats.url is a comma-separated list); percent-encode it (%2C)`},
		{"nats.url unescaped , twice in token", func(c *Config) { c.NATS.URL = "tls://to,k,en@b:2" }, `nats.url: "tls://REDACTED@b:2": a ","`},
		{"nats.url percent-encoded , ok", func(c *Config) { c.NATS.URL = "nats://u:s3cr3t%2Cpw@b:2,nats://a:1" }, ""},
		{"nats.stream required", func(c *Config) { c.NATS.Stream = "" }, "nats.stream: required"},
		{"nats.stream chars", func(c *Config) { c.NATS.Stream = "a.b" }, "nats.stream: \"a.b\": may not contain"},
		{"nats.stream named like a delay topic", func(c *Config) { c.NATS.Stream = c.Kafka.Sources[0].Topic }, "nats.stream: \"" + "delay" + "\" is also kafka.sources[0].topic"},
		{"nats.consumer required", func(c *Config) { c.NATS.Consumer = "" }, "nats.consumer: required"},
		{"nats.consumer chars", func(c *Config) { c.NATS.Consumer = "a b" }, "nats.consumer:"},
		{"nats.replicas 3 with create ok", func(c *Config) { c.NATS.Create, c.NATS.Replicas = true, 3 }, ""},
		{"nats.replicas 5 with create ok", func(c *Config) { c.NATS.Create, c.NATS.Replicas = true, 5 }, ""},
		{"nats.replicas 6", func(c *Config) { c.NATS.Create, c.NATS.Replicas = true, 6 }, "nats.replicas: 6: JetStream takes 1 to 5"},
		{"nats.replicas negative", func(c *Config) { c.NATS.Create, c.NATS.Replicas = true, -1 }, "nats.replicas: -1: JetStream takes 1 to 5"},
		{"nats.replicas without create", func(c *Config) { c.NATS.Replicas = 3 }, "nats.replicas: the bridge sets the stream's replicas only with nats.create: true"},
		{"nats.sources required", func(c *Config) { c.NATS.Sources = nil }, "nats.sources: required"},
		{"nats subject required", func(c *Config) { c.NATS.Sources[0].Subject = "" }, "nats.sources[0].subject: required"},
		{"nats subject empty token", func(c *Config) { c.NATS.Sources[0].Subject = "a..b" }, "nats.sources[0].subject: subject \"a..b\" has an empty token"},
		{"nats subject > not last", func(c *Config) { c.NATS.Sources[0].Subject = "a.>.b" }, "nats.sources[0].subject: subject \"a.>.b\": '>' must be the last token"},
		{"nats subject partial wildcard", func(c *Config) { c.NATS.Sources[0].Subject = "a.b*" }, "nats.sources[0].subject:"},
		{"nats dlq too long", func(c *Config) { c.NATS.Sources[0].DLQ = "dlq." + strings.Repeat("x", 1021) }, "is longer than 1024 bytes"},
		{"nats subject dup", func(c *Config) {
			c.NATS.Sources = append(c.NATS.Sources, NATSSource{Subject: "delay.>", DLQ: "x.y"})
		}, `nats.sources[1].subject: "delay.>" is listed twice`},
		{"nats subjects overlap", func(c *Config) {
			c.NATS.Sources = append(c.NATS.Sources, NATSSource{Subject: "delay.*.x", DLQ: "x.y"})
		}, `nats.sources[1].subject: "delay.*.x" overlaps nats.sources[0].subject "delay.>"`},
		{"nats subjects disjoint ok", func(c *Config) {
			c.NATS.Sources = append(c.NATS.Sources, NATSSource{Subject: "later.*", DLQ: "x.y"})
		}, ""},
		{"nats dlq required", func(c *Config) { c.NATS.Sources[0].DLQ = "" }, "nats.sources[0].dlq: required"},
		{"nats dlq wildcard", func(c *Config) { c.NATS.Sources[0].DLQ = "dlq.*" }, "nats.sources[0].dlq: subject \"dlq.*\": wildcards are not allowed"},
		{"nats dlq matched by own subject", func(c *Config) { c.NATS.Sources[0].DLQ = "delay.dlq" }, `nats.sources[0].dlq: "delay.dlq" is matched by nats.sources[0].subject "delay.>": dead letters would loop`},
		{"nats dlq matched by other subject", func(c *Config) {
			c.NATS.Sources = append(c.NATS.Sources, NATSSource{Subject: "dlq.*", DLQ: "other.dlq"})
		}, `nats.sources[0].dlq: "dlq.delay" is matched by nats.sources[1].subject "dlq.*"`},
		{"nats dlq sibling ok", func(c *Config) { c.NATS.Sources[0].DLQ = "delay" }, ""},
		{"nats default target", func(c *Config) { c.NATS.Sources[0].DefaultTarget = "a.*" }, "nats.sources[0].default_target: codec: target \"a.*\": NATS subject has wildcard"},
		{"nats default target cross", func(c *Config) { c.NATS.Sources[0].DefaultTarget = "kafka:bad topic" }, "nats.sources[0].default_target: codec: target \"kafka:bad topic\""},
		{"nats default target a delay subject", func(c *Config) { c.NATS.Sources[0].DefaultTarget = "delay.x" }, `nats.sources[0].default_target: "delay.x" is a delay source of this bridge`},
		{"kafka default target the delay topic", func(c *Config) { c.Kafka.Sources[0].DefaultTarget = "nats:delay.y" }, `kafka.sources[0].default_target: "nats:delay.y" is a delay source of this bridge`},
		{"nats default target a kafka delay topic", func(c *Config) { c.NATS.Sources[0].DefaultTarget = "kafka:delay" }, `nats.sources[0].default_target: "kafka:delay" is a delay source of this bridge`},
		{"default target unknown prefix", func(c *Config) { c.NATS.Sources[0].DefaultTarget = "foo:bar" }, "nats.sources[0].default_target: codec: target \"foo:bar\": unknown transport prefix"},
		{"nats dlq control char", func(c *Config) { c.NATS.Sources[0].DLQ = "dlq\x01x" }, "nats.sources[0].dlq: subject"},
		{"nats user without password", func(c *Config) { c.NATS.User = "u" }, "nats.password: required with nats.user"},
		{"nats password without user", func(c *Config) { c.NATS.Password = "p" }, "nats.user: required with nats.password"},
		{"nats two auth methods", func(c *Config) { c.NATS.Token = "t"; c.NATS.CredsFile = readable }, "nats: set only one of user/password, token and creds_file"},
		{"nats creds unreadable", func(c *Config) { c.NATS.CredsFile = missing }, "nats.creds_file: not readable"},
		// A file without a user JWT and its nkey seed passed --check and
		// failed at the first connect, naming the file but not the key.
		{"nats creds without a seed", func(c *Config) { c.NATS.CredsFile = readable }, "nats.creds_file: " + readable + " is not a NATS .creds file (a user JWT and its nkey seed): nkeys: no nkey seed found"},
		{"nats creds without a JWT", func(c *Config) { c.NATS.CredsFile = seedOnly }, "nats.creds_file: " + seedOnly + " is not a NATS .creds file (a user JWT and its nkey seed): no user JWT"},
		{"nats creds ok", func(c *Config) { c.NATS.CredsFile = creds }, ""},
		{"nats user/pass ok", func(c *Config) { c.NATS.User = "u"; c.NATS.Password = "p" }, ""},

		// targets
		{"targets bad class", func(c *Config) { c.Targets.Allow = []string{"*", "orders.[a-"} }, "targets.allow[1]: bad pattern \"orders.[a-\""},
		{"targets empty token", func(c *Config) { c.Targets.Allow = []string{"a..b"} }, "targets.allow[0]: bad pattern"},
		{"targets > middle", func(c *Config) { c.Targets.Allow = []string{"a.>.b"} }, "targets.allow[0]: bad pattern \"a.>.b\": \">\" must be the whole last token"},
		{"targets empty name", func(c *Config) { c.Targets.Allow = []string{"kafka:"} }, "targets.allow[0]: bad pattern \"kafka:\": empty name pattern"},
		// A URL matches no target (codec refuses "//" names as bad-target).
		{"targets URL", func(c *Config) { c.Targets.Allow = []string{"orders.*", "kafka://orders.*"} }, "targets.allow[1]: bad pattern \"kafka://orders.*\": a URL, not a pattern"},
		{"targets URL no prefix", func(c *Config) { c.Targets.Allow = []string{"//x"} }, "targets.allow[0]: bad pattern \"//x\": a URL"},
		{"targets trailing backslash", func(c *Config) { c.Targets.Allow = []string{`a\`} }, "targets.allow[0]: bad pattern"},
		{"targets stray ]", func(c *Config) { c.Targets.Allow = []string{"a]"} }, "targets.allow[0]: bad pattern"},
		{"targets kafka comma", func(c *Config) { c.Targets.Allow = []string{"nats:a,b", "kafka:a,b"} }, `targets.allow[1]: bad pattern "kafka:a,b": a Kafka topic cannot contain ","`},
		{"targets empty ok", func(c *Config) { c.Targets.Allow = nil }, ""},

		// admin
		{"admin.listen required", func(c *Config) { c.Admin.Listen = "" }, "admin.listen: required"},
		{"admin.listen syntax", func(c *Config) { c.Admin.Listen = "8080" }, "admin.listen: \"8080\" is not host:port"},
		{"admin any address without token", func(c *Config) { c.Admin.Listen = ":8080" }, "admin.listen: \":8080\" is reachable from other hosts"},
		{"admin 0.0.0.0 without token", func(c *Config) { c.Admin.Listen = "0.0.0.0:8080" }, "admin.listen:"},
		{"admin with token ok", func(c *Config) { c.Admin.Listen = "0.0.0.0:8080"; c.Admin.Token = "t" }, ""},
		{"admin insecure allowed", func(c *Config) { c.Admin.Listen = ":8080"; c.Admin.AllowInsecureListen = true }, ""},
		// A bearer token no Authorization header can carry (HTTP trims
		// the white space around a header value and forbids control
		// characters) would make every /metrics and /v1 call a 401.
		{"admin token trailing space", func(c *Config) { c.Admin.Token = "s3cr3t " }, "admin.token: must not begin or end with white space"},
		{"admin token leading tab", func(c *Config) { c.Admin.Token = "\ts3cr3t" }, "admin.token: must not begin or end with white space"},
		{"admin token blank", func(c *Config) { c.Admin.Listen = "0.0.0.0:8080"; c.Admin.Token = " " }, "admin.token: must not begin or end with white space"},
		{"admin token control character", func(c *Config) { c.Admin.Token = "s3\nc\x00r3t" }, "admin.token: must not hold control characters"},
		{"admin token from a file", func(c *Config) { c.Admin.Token, c.Admin.TokenFile = "s3cr3t ", "/run/token" }, "admin.token: must not begin or end with white space (read from admin.token_file /run/token)"},
		{"metrics token ok", func(c *Config) { c.Admin.Token, c.Admin.MetricsToken = "adm", "scrape" }, ""},
		{"metrics token without admin token", func(c *Config) { c.Admin.MetricsToken = "scrape" }, "admin.metrics_token: needs admin.token"},
		{"metrics token same as admin token", func(c *Config) { c.Admin.Token, c.Admin.MetricsToken = "adm", "adm" }, "admin.metrics_token: must differ from admin.token"},
		{"metrics token trailing space", func(c *Config) { c.Admin.Token, c.Admin.MetricsToken = "adm", "scrape " }, "admin.metrics_token: must not begin or end with white space"},
		{"admin token inner space ok", func(c *Config) { c.Admin.Token = "s3 cr3t" }, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := mustLoad(t, validYAML)
			tt.mutate(c)
			err := c.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("no error, want %q", tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %q does not contain %q", err, tt.want)
			}
			if strings.Contains(err.Error(), "s3cr3t") {
				t.Fatalf("error %q shows a secret", err)
			}
		})
	}
}

func TestValidateReportsAll(t *testing.T) {
	c := &Config{}
	err := c.Validate()
	if err == nil {
		t.Fatal("zero config valid")
	}
	for _, key := range []string{"data_dir:", "shards:", "horizon:", "max_message_bytes:", "fire_batch:", "store.cache_mb:",
		"retry.initial:", "retry.multiplier:", "retry.max_attempts:", "shutdown_timeout:", "log.level:",
		"log.format:", "kafka, nats:", "admin.listen:"} {
		if !strings.Contains(err.Error(), key) {
			t.Errorf("missing %q in\n%v", key, err)
		}
	}
}

func TestCheckListen(t *testing.T) {
	tests := []struct {
		listen, token string
		insecure      bool
		ok            bool
	}{
		{"127.0.0.1:8080", "", false, true},
		{"127.1.2.3:8080", "", false, true},
		{"[::1]:8080", "", false, true},
		{"localhost:8080", "", false, true},
		{"LOCALHOST:0", "", false, true},
		{":8080", "", false, false},
		{"0.0.0.0:8080", "", false, false},
		{"[::]:8080", "", false, false},
		{"10.0.0.5:8080", "", false, false},
		{"admin.example.com:8080", "", false, false},
		{"0.0.0.0:8080", "tok", false, true},
		{"0.0.0.0:8080", "", true, true},
		{"no-port", "tok", false, false},
		{"127.0.0.1:99999", "", false, false},
	}
	for _, tt := range tests {
		err := CheckListen(tt.listen, tt.token, tt.insecure)
		if (err == nil) != tt.ok {
			t.Errorf("CheckListen(%q, %q, %v) = %v, want ok=%v", tt.listen, tt.token, tt.insecure, err, tt.ok)
		}
		if err != nil && !strings.HasPrefix(err.Error(), "admin.listen: ") {
			t.Errorf("error %q does not name admin.listen", err)
		}
	}
}

func TestSubjectsOverlap(t *testing.T) {
	tests := []struct {
		a, b string
		want bool
	}{
		{"a.>", "a.b", true},
		{"a.>", "a", false},
		{"a.*", "a.b", true},
		{"a.*", "a.b.c", false},
		{"a.*.c", "a.b.*", true},
		{"a.*.c", "a.b.d", false},
		{"*.>", "x.y.z", true},
		{">", "a", true},
		{"a.b", "a.b", true},
		{"a.b", "a.c", false},
		{"a", "a.b", false},
	}
	for _, tt := range tests {
		if got := subjectsOverlap(tt.a, tt.b); got != tt.want {
			t.Errorf("subjectsOverlap(%q, %q) = %v", tt.a, tt.b, got)
		}
		if got := subjectsOverlap(tt.b, tt.a); got != tt.want {
			t.Errorf("subjectsOverlap(%q, %q) = %v (reversed)", tt.b, tt.a, got)
		}
	}
}

func TestSubjectMatches(t *testing.T) {
	tests := []struct {
		filter, subject string
		want            bool
	}{
		{"delay.>", "delay.a", true},
		{"delay.>", "delay.a.b", true},
		{"delay.>", "delay", false},
		{"delay.*", "delay.a", true},
		{"delay.*", "delay.a.b", false},
		{"*.dlq", "x.dlq", true},
		{">", "anything.at.all", true},
		{"a.b", "a.b", true},
		{"a.b", "a.c", false},
	}
	for _, tt := range tests {
		if got := SubjectMatches(tt.filter, tt.subject); got != tt.want {
			t.Errorf("SubjectMatches(%q, %q) = %v", tt.filter, tt.subject, got)
		}
	}
}

// subjectMatchesSplit is SubjectMatches written plainly (strings.Split),
// the reference for TestSubjectMatchesAll.
func subjectMatchesSplit(filter, subject string) bool {
	f := strings.Split(filter, ".")
	s := strings.Split(subject, ".")
	for i, ft := range f {
		if ft == ">" {
			return len(s) > i
		}
		if i >= len(s) || (ft != "*" && ft != s[i]) {
			return false
		}
	}
	return len(f) == len(s)
}

// TestSubjectMatchesAll: SubjectMatches agrees with the plain reference on
// every filter and subject of up to three tokens from "", a, b, * and >,
// and allocates nothing.
func TestSubjectMatchesAll(t *testing.T) {
	var all []string
	var gen func(pre string, n int)
	gen = func(pre string, n int) {
		all = append(all, pre)
		if n == 0 {
			return
		}
		for _, tk := range []string{"", "a", "b", "*", ">"} {
			if pre == "" {
				gen(tk, n-1)
			} else {
				gen(pre+"."+tk, n-1)
			}
		}
	}
	gen("", 3)
	for _, f := range all {
		for _, s := range all {
			if got, want := SubjectMatches(f, s), subjectMatchesSplit(f, s); got != want {
				t.Fatalf("SubjectMatches(%q, %q) = %v, want %v", f, s, got, want)
			}
		}
	}
	if n := testing.AllocsPerRun(100, func() { SubjectMatches("delay.*.>", "delay.a.b.c") }); n != 0 {
		t.Errorf("SubjectMatches allocates %v times", n)
	}
}

// credsFiles writes a NATS .creds file (a user JWT and its nkey seed, as
// nsc makes it) and a file with the seed alone into dir.
func credsFiles(t *testing.T, dir string) (creds, seedOnly string) {
	t.Helper()
	b, useed := testcert.NATSCreds(t)
	creds, seedOnly = filepath.Join(dir, "user.creds"), filepath.Join(dir, "seed.nk")
	if err := os.WriteFile(creds, b, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(seedOnly, useed, 0o600); err != nil {
		t.Fatal(err)
	}
	return creds, seedOnly
}

// tlsFiles writes a CA certificate, a client certificate it issued with
// its key, and the key of another certificate into dir, in PEM.
func tlsFiles(t *testing.T, dir string) (ca, cert, key, otherKey string) {
	t.Helper()
	c := testcert.NewCA(t, "ca")
	leaf := c.Issue(t, "client", x509.ExtKeyUsageClientAuth)
	other := c.Issue(t, "other", x509.ExtKeyUsageClientAuth)
	files := map[string][]byte{"ca.crt": c.CertPEM(), "tls.crt": leaf.CertPEM(), "tls.key": leaf.KeyPEM(t), "other.key": other.KeyPEM(t)}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return filepath.Join(dir, "ca.crt"), filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"), filepath.Join(dir, "other.key")
}
