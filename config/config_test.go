package config

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// validYAML is a complete configuration that passes Validate.
const validYAML = `
data_dir: /var/lib/delaybridge
kafka:
  brokers: ["localhost:9092"]
  group: delaybridge
  sources:
    - topic: delay
      dlq: delay.dlq
      default_target: ""
nats:
  url: nats://localhost:4222
  stream: DELAY
  consumer: delaybridge
  sources:
    - subject: "delay.>"
      dlq: dlq.delay
targets:
  allow: ["*"]
max_delay: 365d
admin:
  listen: 127.0.0.1:8080
`

func mustLoad(t *testing.T, yml string, env ...string) *Config {
	t.Helper()
	c, err := LoadBytes([]byte(yml), env)
	if err != nil {
		t.Fatalf("LoadBytes: %v", err)
	}
	return c
}

func TestLoadContractExample(t *testing.T) {
	c := mustLoad(t, validYAML)
	want := Default()
	want.DataDir = "/var/lib/delaybridge"
	want.Kafka = &Kafka{
		Brokers: []string{"localhost:9092"}, Group: "delaybridge", ClientID: "delaybridge",
		Sources:       []KafkaSource{{Topic: "delay", DLQ: "delay.dlq"}},
		FetchMemoryMB: DefaultKafkaFetchMemoryMB,
	}
	want.NATS = &NATS{
		URL: "nats://localhost:4222", Stream: "DELAY", Consumer: "delaybridge",
		Sources: []NATSSource{{Subject: "delay.>", DLQ: "dlq.delay"}},
	}
	if !reflect.DeepEqual(c, want) {
		t.Fatalf("got\n%s\nwant\n%s", c, want)
	}
}

func TestLoadFullSchema(t *testing.T) {
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, testcert.NewCA(t, "ca").CertPEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	yml := fmt.Sprintf(`
data_dir: /data
shards: 16
horizon: 1h
max_delay: 30d
max_message_bytes: 2048
cancel_retention: 2d
fire_batch: 100
fire_batch_bytes: 65536
store: {cache_mb: 1024, memtable_mb: 128, reserve_mb: 512}
retry: {initial: 1s, max: 1m, multiplier: 1.5, jitter: 0, max_attempts: 3}
shutdown_timeout: 30s
catch_up_wait: 2m
log: {level: debug, format: console}
kafka:
  brokers: ["a:9092", "b:9092"]
  group: g
  client_id: cid
  tls: {enabled: true, ca_file: %q, server_name: kafka.local, insecure_skip_verify: true}
  sasl: {mechanism: SCRAM-SHA-512, username: u, password: p}
  sources:
    - {topic: delay, dlq: delay.dlq, default_target: "nats:events.x"}
nats:
  url: tls://n1:4222,tls://n2:4222
  stream: S
  consumer: C
  create: true
  replicas: 3
  core_targets: true
  tls: {enabled: true}
  token: tok
  sources:
    - {subject: "delay.>", dlq: dlq.delay, default_target: "kafka:orders"}
targets:
  allow: ["kafka:orders", "nats:events.>"]
admin:
  listen: 0.0.0.0:9090
  token: admintok
`, ca)
	c := mustLoad(t, yml)
	checks := []struct {
		name      string
		got, want any
	}{
		{"shards", c.Shards, 16},
		{"horizon", c.Horizon.Std(), time.Hour},
		{"max_delay", c.MaxDelay.Std(), 30 * 24 * time.Hour},
		{"max_message_bytes", c.MaxMessageBytes, 2048},
		{"cancel_retention", c.CancelRetention.Std(), 48 * time.Hour},
		{"fire_batch", c.FireBatch, 100},
		{"fire_batch_bytes", c.FireBatchBytes, 65536},
		{"store", c.Store, Store{CacheMB: 1024, MemtableMB: 128, ReserveMB: 512}},
		{"retry", c.Retry, Retry{Initial: Duration(time.Second), Max: Duration(time.Minute), Multiplier: 1.5, Jitter: 0, MaxAttempts: 3, WaitingInMemory: DefaultWaitingInMemory}},
		{"shutdown_timeout", c.ShutdownTimeout.Std(), 30 * time.Second},
		{"catch_up_wait", c.CatchUpWait.Std(), 2 * time.Minute},
		{"log", c.Log, Log{Level: "debug", Format: "console"}},
		{"kafka.brokers", c.Kafka.Brokers, []string{"a:9092", "b:9092"}},
		{"kafka.group", c.Kafka.Group, "g"},
		{"kafka.client_id", c.Kafka.ClientID, "cid"},
		{"kafka.tls", c.Kafka.TLS, TLS{Enabled: true, CAFile: ca, ServerName: "kafka.local", InsecureSkipVerify: true}},
		{"kafka.sasl", c.Kafka.SASL, SASL{Mechanism: "SCRAM-SHA-512", Username: "u", Password: "p"}},
		{"kafka.sources", c.Kafka.Sources, []KafkaSource{{Topic: "delay", DLQ: "delay.dlq", DefaultTarget: "nats:events.x"}}},
		{"nats.url", c.NATS.URL, "tls://n1:4222,tls://n2:4222"},
		{"nats.stream", c.NATS.Stream, "S"},
		{"nats.consumer", c.NATS.Consumer, "C"},
		{"nats.create", c.NATS.Create, true},
		{"nats.replicas", c.NATS.Replicas, 3},
		{"nats.core_targets", c.NATS.CoreTargets, true},
		{"nats.token", c.NATS.Token.Value(), "tok"},
		{"nats.sources", c.NATS.Sources, []NATSSource{{Subject: "delay.>", DLQ: "dlq.delay", DefaultTarget: "kafka:orders"}}},
		{"targets.allow", c.Targets.Allow, []string{"kafka:orders", "nats:events.>"}},
		{"admin", c.Admin, Admin{Listen: "0.0.0.0:9090", Token: "admintok"}},
	}
	for _, ck := range checks {
		if !reflect.DeepEqual(ck.got, ck.want) {
			t.Errorf("%s = %#v, want %#v", ck.name, ck.got, ck.want)
		}
	}
}

func TestLoadDefaults(t *testing.T) {
	c := mustLoad(t, "data_dir: /d\nkafka: {brokers: [k:9092], sources: [{topic: t, dlq: t.dlq}]}\n")
	if c.NATS != nil {
		t.Fatal("nats enabled without a nats block")
	}
	if c.Kafka.Group != DefaultKafkaGroup || c.Kafka.ClientID != DefaultKafkaClientID {
		t.Fatalf("kafka defaults: %+v", c.Kafka)
	}
	d := Default()
	if c.Shards != d.Shards || c.Horizon != d.Horizon || c.MaxDelay != d.MaxDelay || c.Retry != d.Retry ||
		c.Admin.Listen != DefaultAdminListen || !reflect.DeepEqual(c.Targets.Allow, []string{"*"}) {
		t.Fatalf("defaults not applied:\n%s", c)
	}
	n := mustLoad(t, "data_dir: /d\nnats: {sources: [{subject: a.>, dlq: b}]}\n").NATS
	if n.URL != DefaultNATSURL || n.Stream != DefaultNATSStream || n.Consumer != DefaultNATSConsumer || n.CoreTargets {
		t.Fatalf("nats defaults: %+v", n)
	}
}

// An explicit zero must not be replaced by the default.
func TestLoadExplicitZeroKept(t *testing.T) {
	c := mustLoad(t, validYAML+"retry: {jitter: 0}\ncancel_retention: 0s\n")
	if c.Retry.Jitter != 0 || c.CancelRetention != 0 {
		t.Fatalf("jitter %v cancel_retention %v, want 0", c.Retry.Jitter, c.CancelRetention)
	}
	if c.Retry.Multiplier != 2 {
		t.Fatalf("other retry keys lost their defaults: %+v", c.Retry)
	}
	c = mustLoad(t, strings.Replace(validYAML, "max_delay: 365d", "max_delay: 0", 1))
	if c.MaxDelay != 0 {
		t.Fatal("max_delay: 0 not kept")
	}
}

func TestLoadEmptyAllowDeniesAll(t *testing.T) {
	c := mustLoad(t, strings.Replace(validYAML, `allow: ["*"]`, "allow: []", 1))
	if len(c.Targets.Allow) != 0 || c.AllowTarget(1, "x") {
		t.Fatalf("allow %q should deny", c.Targets.Allow)
	}
}

func TestLoadYAMLErrors(t *testing.T) {
	tests := []struct {
		name string
		yml  string
		want []string // substrings of the error
	}{
		{"unknown top-level key", validYAML + "bogus: 1\n", []string{"line 22: bogus: unknown key"}},
		{"unknown nested key", strings.Replace(validYAML, "group: delaybridge", "gruop: delaybridge", 1), []string{"line 5: kafka.gruop: unknown key"}},
		{"unknown key in list item", strings.Replace(validYAML, "dlq: delay.dlq", "dlq: delay.dlq\n      topik: x", 1), []string{"kafka.sources[0].topik: unknown key"}},
		{"duplicate key", validYAML + "shards: 2\nshards: 3\n", []string{"shards: duplicate key"}},
		{"bad int", validYAML + "shards: many\n", []string{`line 22: shards: invalid integer "many"`}},
		{"bad bool", strings.Replace(validYAML, "stream: DELAY", "create: maybe", 1), []string{`nats.create: invalid boolean "maybe"`}},
		{"bad bool core_targets", strings.Replace(validYAML, "stream: DELAY", "core_targets: sometimes", 1), []string{`nats.core_targets: invalid boolean "sometimes"`}},
		{"misspelled core_targets", strings.Replace(validYAML, "stream: DELAY", "core_target: true", 1), []string{"nats.core_target: unknown key"}},
		{"bad duration", validYAML + "horizon: 10\n", []string{"horizon:", `invalid duration "10"`}},
		{"bad float", validYAML + "retry: {jitter: lots}\n", []string{"retry.jitter: invalid number"}},
		{"mapping for scalar", strings.Replace(validYAML, "data_dir: /var/lib/delaybridge", "data_dir: {a: 1}", 1), []string{"data_dir: want a single value, got a mapping"}},
		// The error says how to write the list (the environment's
		// comma-separated form copied into the file, too).
		{"scalar for list", strings.Replace(validYAML, `brokers: ["localhost:9092"]`, "brokers: localhost:9092", 1), []string{`kafka.brokers: want a list, got the value "localhost:9092"; write it as a list: ["localhost:9092"]`}},
		{"comma-separated scalar for list", strings.Replace(validYAML, `brokers: ["localhost:9092"]`, "brokers: a:9092, b:9092", 1), []string{`kafka.brokers: want a list, got the value "a:9092, b:9092"; write it as a list: ["a:9092", "b:9092"] (one comma-separated value is the form of a DELAYBRIDGE_ variable)`}},
		{"scalar for block", validYAML + "log: verbose\n", []string{"log: want a mapping of keys"}},
		{"two documents", validYAML + "---\nshards: 1\n", []string{"second document"}},
		{"syntax error", "data_dir: [\n", []string{"yaml:"}},
		{"syntax error named once", "data_dir: /x\n  bad: [\n", []string{"yaml: line 2: mapping values are not allowed"}},
		{"all errors at once", validYAML + "a: 1\nb: 2\n", []string{"a: unknown key", "b: unknown key"}},
		{"top level list", "- 1\n", []string{"(top level): want a mapping"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadBytes([]byte(tt.yml), nil)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "yaml: yaml:") {
				t.Errorf("error %q names the parser twice", err)
			}
		})
	}
}

func TestLoadYAMLAnchorsAndMerge(t *testing.T) {
	yml := `
data_dir: /d
x-src: &src {dlq: delay.dlq}
`
	if _, err := LoadBytes([]byte(yml), nil); err == nil || !strings.Contains(err.Error(), "x-src: unknown key") {
		t.Fatalf("extension key accepted: %v", err)
	}
	yml = `
data_dir: /d
kafka:
  brokers: &b ["k:9092"]
  sources:
    - &s {topic: one, dlq: one.dlq}
    - {<<: *s, topic: two}
nats: {sources: [{subject: "a.>", dlq: b}]}
`
	c := mustLoad(t, yml)
	want := []KafkaSource{{Topic: "one", DLQ: "one.dlq"}, {Topic: "two", DLQ: "one.dlq"}}
	if !reflect.DeepEqual(c.Kafka.Sources, want) {
		t.Fatalf("sources %+v, want %+v", c.Kafka.Sources, want)
	}
}

func TestLoadAliasBomb(t *testing.T) {
	var b strings.Builder
	b.WriteString("data_dir: /d\nkafka:\n  sources:\n    - &l0 {topic: t, dlq: d}\n")
	// Each list item merges the previous one ten times: 10^12 visits if
	// expanded naively.
	for i := 1; i <= 12; i++ {
		fmt.Fprintf(&b, "    - &l%d {<<: [", i)
		for j := range 10 {
			if j > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "*l%d", i-1)
		}
		b.WriteString("]}\n")
	}
	done := make(chan error, 1)
	go func() { _, err := LoadBytes([]byte(b.String()), nil); done <- err }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "expands too far") {
			t.Fatalf("error %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("alias expansion not bounded")
	}
	for _, yml := range []string{"kafka: &x {<<: *x}\n", "retry: &x {<<: [*x, *x]}\n"} {
		if _, err := LoadBytes([]byte(yml), nil); err == nil || !strings.Contains(err.Error(), "expands too far") {
			t.Errorf("%q: %v", yml, err)
		}
	}
}

func TestLoadFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte(validYAML), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(p, nil); err != nil {
		t.Fatal(err)
	}
	_, err := Load(filepath.Join(t.TempDir(), "missing.yaml"), nil)
	if err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Fatalf("missing file: %v", err)
	}
	if err := os.WriteFile(p, []byte(validYAML+"bogus: 1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err = Load(p, nil); err == nil || !strings.Contains(err.Error(), p) || !strings.Contains(err.Error(), "bogus") {
		t.Fatalf("error should name file and key: %v", err)
	}
}

func writeSecret(t *testing.T, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestSecretsFromFiles(t *testing.T) {
	kp := writeSecret(t, "kafka-pass\n")
	np := writeSecret(t, "nats-pass")
	at := writeSecret(t, "admin-token\r\n")
	yml := validYAML
	env := []string{
		"DELAYBRIDGE_KAFKA_SASL_MECHANISM=PLAIN",
		"DELAYBRIDGE_KAFKA_SASL_USERNAME=u",
		"DELAYBRIDGE_KAFKA_SASL_PASSWORD_FILE=" + kp,
		"DELAYBRIDGE_NATS_USER=nu",
		"DELAYBRIDGE_NATS_PASSWORD_FILE=" + np,
		"DELAYBRIDGE_ADMIN_TOKEN_FILE=" + at,
	}
	c := mustLoad(t, yml, env...)
	if got := c.Kafka.SASL.Password.Value(); got != "kafka-pass" {
		t.Errorf("kafka password %q", got)
	}
	if got := c.NATS.Password.Value(); got != "nats-pass" {
		t.Errorf("nats password %q", got)
	}
	if got := c.Admin.Token.Value(); got != "admin-token" {
		t.Errorf("admin token %q", got)
	}
	// String (run --check's YAML) leaves out the secrets read from files,
	// which it names, so it loads back as a config reading them again:
	// with "password: REDACTED" beside "password_file" it conflicted (hunt
	// H211).
	out := c.String()
	for _, sec := range []string{"kafka-pass", "nats-pass", "admin-token", "REDACTED"} {
		if strings.Contains(out, sec) {
			t.Errorf("String shows %q:\n%s", sec, out)
		}
	}
	back, err := LoadBytes([]byte(out), nil)
	if err != nil {
		t.Fatalf("String of a config with secrets from files does not load back: %v\n%s", err, out)
	}
	if back.Kafka.SASL.Password.Value() != "kafka-pass" || back.NATS.Password.Value() != "nats-pass" || back.Admin.Token.Value() != "admin-token" {
		t.Errorf("loaded back: kafka %q, nats %q, admin %q; want the files' secrets", back.Kafka.SASL.Password.Value(), back.NATS.Password.Value(), back.Admin.Token.Value())
	}
	mt := writeSecret(t, "scrape\n")
	c = mustLoad(t, validYAML, "DELAYBRIDGE_ADMIN_TOKEN_FILE="+at, "DELAYBRIDGE_ADMIN_METRICS_TOKEN_FILE="+mt)
	if got := c.Admin.MetricsToken.Value(); got != "scrape" {
		t.Errorf("metrics token %q", got)
	}
	if r := c.Redacted(); r.Admin.MetricsToken.Value() != "REDACTED-METRICS" { // not admin.token's REDACTED: R225
		t.Errorf("redacted metrics token %q", r.Admin.MetricsToken.Value())
	}
	tf := writeSecret(t, "nats-token")
	c = mustLoad(t, validYAML, "DELAYBRIDGE_NATS_TOKEN_FILE="+tf)
	if c.NATS.Token.Value() != "nats-token" {
		t.Errorf("nats token %q", c.NATS.Token.Value())
	}

	errTests := []struct {
		name string
		env  []string
		want string
	}{
		{"missing file", []string{"DELAYBRIDGE_ADMIN_TOKEN_FILE=/nonexistent/tok"}, "admin.token_file (from DELAYBRIDGE_ADMIN_TOKEN_FILE): open /nonexistent/tok"},
		{"empty file", []string{"DELAYBRIDGE_ADMIN_TOKEN_FILE=" + writeSecret(t, "\n")}, "admin.token_file (from DELAYBRIDGE_ADMIN_TOKEN_FILE): "},
		{"both inline and file", []string{"DELAYBRIDGE_ADMIN_TOKEN=x", "DELAYBRIDGE_ADMIN_TOKEN_FILE=" + at}, "admin.token_file (from DELAYBRIDGE_ADMIN_TOKEN_FILE): conflicts with admin.token (from DELAYBRIDGE_ADMIN_TOKEN)"},
		{"nats token both", []string{"DELAYBRIDGE_NATS_TOKEN=x", "DELAYBRIDGE_NATS_TOKEN_FILE=" + at}, "nats.token_file (from DELAYBRIDGE_NATS_TOKEN_FILE): conflicts"},
		{"listen exposed without a token", []string{"DELAYBRIDGE_ADMIN_LISTEN=0.0.0.0:8080"}, `admin.listen (from DELAYBRIDGE_ADMIN_LISTEN): "0.0.0.0:8080" is reachable from other hosts`},
		{"listen not host:port", []string{"DELAYBRIDGE_ADMIN_LISTEN=8080"}, `admin.listen (from DELAYBRIDGE_ADMIN_LISTEN): "8080" is not host:port`},
	}
	for _, tt := range errTests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadBytes([]byte(validYAML), tt.env)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %v, want %q", err, tt.want)
			}
		})
	}
}

// TestSecretFileTrimsOneNewline: a *_file secret loses exactly one trailing
// "\n" or "\r\n" (the one editors and echo add), as the package doc says;
// any other trailing byte, including a further newline, is the secret's.
func TestSecretFileTrimsOneNewline(t *testing.T) {
	tests := []struct {
		content, want string
	}{
		{"pass", "pass"},
		{"pass\n", "pass"},
		{"pass\r\n", "pass"},
		{"pass\n\n", "pass\n"},
		{"pass\r\n\r\n", "pass\r\n"},
		{"pass\n\r\n", "pass\n"},
		{"pass\r\n\n", "pass\r\n"},
		{"pass\r", "pass\r"},
		{"pass\n\r", "pass\n\r"},
		{" pass \n", " pass "},
	}
	for _, tc := range tests {
		t.Run(strconv.Quote(tc.content), func(t *testing.T) {
			c := mustLoad(t, validYAML, "DELAYBRIDGE_NATS_USER=nu", "DELAYBRIDGE_NATS_PASSWORD_FILE="+writeSecret(t, tc.content))
			if got := c.NATS.Password.Value(); got != tc.want {
				t.Errorf("password %q, want %q", got, tc.want)
			}
		})
	}
	for _, content := range []string{"", "\n", "\r\n"} {
		t.Run("empty "+strconv.Quote(content), func(t *testing.T) {
			_, err := LoadBytes([]byte(validYAML), []string{"DELAYBRIDGE_NATS_USER=nu", "DELAYBRIDGE_NATS_PASSWORD_FILE=" + writeSecret(t, content)})
			if err == nil || !strings.Contains(err.Error(), "nats.password_file (from DELAYBRIDGE_NATS_PASSWORD_FILE): ") || !strings.Contains(err.Error(), "is empty") {
				t.Fatalf("error %v, want nats.password_file (from DELAYBRIDGE_NATS_PASSWORD_FILE): ... is empty", err)
			}
		})
	}
}

func TestRedaction(t *testing.T) {
	c := mustLoad(t, validYAML,
		"DELAYBRIDGE_KAFKA_SASL_MECHANISM=PLAIN", "DELAYBRIDGE_KAFKA_SASL_USERNAME=u",
		"DELAYBRIDGE_KAFKA_SASL_PASSWORD=s3cr3t-kafka",
		"DELAYBRIDGE_NATS_TOKEN=s3cr3t-nats",
		"DELAYBRIDGE_ADMIN_TOKEN=s3cr3t-admin")
	secrets := []string{"s3cr3t-kafka", "s3cr3t-nats", "s3cr3t-admin"}

	core, logs := observer.New(zapcore.DebugLevel)
	zap.New(core).Info("config", zap.Object("config", c), zap.Any("any", c))
	enc := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig())
	buf, err := enc.EncodeEntry(logs.All()[0].Entry, logs.All()[0].Context)
	if err != nil {
		t.Fatal(err)
	}
	js, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	forms := map[string]string{
		"json":       string(js),
		"String":     c.String(),
		"%v":         fmt.Sprintf("%v", c),
		"%+v value":  fmt.Sprintf("%+v", *c),
		"%+v kafka":  fmt.Sprintf("%+v", *c.Kafka),
		"%#v kafka":  fmt.Sprintf("%#v", *c.Kafka),
		"%s secret":  fmt.Sprintf("%s", c.Admin.Token), //lint:ignore S1025 the %s verb itself is under test
		"zap json":   buf.String(),
		"Redacted()": fmt.Sprintf("%s %s %s", c.Redacted().Kafka.SASL.Password.Value(), c.Redacted().NATS.Token.Value(), c.Redacted().Admin.Token.Value()),
	}
	for name, s := range forms {
		for _, sec := range secrets {
			if strings.Contains(s, sec) {
				t.Errorf("%s leaks %q:\n%s", name, sec, s)
			}
		}
	}
	if !strings.Contains(forms["zap json"], `"password":"REDACTED"`) || !strings.Contains(forms["zap json"], `"data_dir":"/var/lib/delaybridge"`) {
		t.Errorf("zap form lacks keys: %s", forms["zap json"])
	}
	if !strings.Contains(forms["String"], "token: REDACTED") {
		t.Errorf("String lacks redacted token:\n%s", forms["String"])
	}
	// Redacted is a copy: the original keeps its secrets.
	if c.Admin.Token.Value() != "s3cr3t-admin" || c.Kafka.SASL.Password.Value() != "s3cr3t-kafka" {
		t.Fatal("Redacted modified the original")
	}
	r := c.Redacted()
	r.Kafka.Sources[0].Topic = "changed"
	if c.Kafka.Sources[0].Topic == "changed" {
		t.Fatal("Redacted shares slices with the original")
	}
}

// TestRedactionNATSURL: nats.url may carry credentials ("nats://user:pass@host",
// "nats://token@host", as the NATS client accepts them); the forms that are
// logged (Redacted, String, zap) and the validation errors must not show them.
// TestRedactURLsComma: a comma in a credential that is not
// percent-encoded (refused at load, in an error that shows the URL
// through RedactURLs) is redacted with the rest of it: split at the
// comma, "nats://u:s3cr3t" had no "@" and was shown as it is.
func TestRedactURLsComma(t *testing.T) {
	for _, tc := range []struct{ url, want string }{
		{"nats://u:s3cr3t,w@nats:4222", "nats://REDACTED@nats:4222"},
		{"nats://a:1,tls://u:s3cr3t,x,y@b:2", "nats://a:1,tls://REDACTED@b:2"},
		{"tok@h1,nats://h2", "REDACTED@h1,nats://h2"},
		{"nats://a:1, nats://b:2", "nats://a:1, nats://b:2"},
	} {
		if got := RedactURLs(tc.url); got != tc.want {
			t.Errorf("RedactURLs(%q) = %q, want %q", tc.url, got, tc.want)
		}
	}
}

func TestRedactionNATSURL(t *testing.T) {
	for _, tc := range []struct {
		url, secret, want string
	}{
		{"nats://alice:s3cr3t-pw@nats:4222", "s3cr3t-pw", "nats://REDACTED@nats:4222"},
		{"nats://s3cr3t-token@nats:4222", "s3cr3t-token", "nats://REDACTED@nats:4222"},
		{"nats://a:4222, tls://bob:s3cr3t-2@b:4222", "s3cr3t-2", "nats://a:4222, tls://REDACTED@b:4222"},
		{"nats://u:s3cr3t@w@nats:4222", "s3cr3t", "nats://REDACTED@nats:4222"},
		{"nats://nats:4222", "", "nats://nats:4222"},
	} {
		t.Run(tc.url, func(t *testing.T) {
			c := mustLoad(t, validYAML, "DELAYBRIDGE_NATS_URL="+tc.url)
			if got := c.Redacted().NATS.URL; got != tc.want {
				t.Errorf("Redacted().NATS.URL = %q, want %q", got, tc.want)
			}
			if c.NATS.URL != tc.url {
				t.Fatalf("Redacted modified the original: %q", c.NATS.URL)
			}
			if tc.secret == "" {
				return
			}
			core, logs := observer.New(zapcore.DebugLevel)
			zap.New(core).Info("config", zap.Object("config", c))
			buf, err := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()).EncodeEntry(logs.All()[0].Entry, logs.All()[0].Context)
			if err != nil {
				t.Fatal(err)
			}
			for name, s := range map[string]string{"String": c.String(), "%v": fmt.Sprintf("%v", c), "zap": buf.String()} {
				if strings.Contains(s, tc.secret) {
					t.Errorf("%s leaks %q:\n%s", name, tc.secret, s)
				}
			}
		})
	}
	// A URL refused by Validate is named without its credentials.
	_, err := LoadBytes([]byte(validYAML), []string{"DELAYBRIDGE_NATS_URL=http://alice:s3cr3t-pw@nats:4222"})
	if err == nil || !strings.Contains(err.Error(), "nats.url") || strings.Contains(err.Error(), "s3cr3t-pw") {
		t.Errorf("error %v: want nats.url named without the password", err)
	}
}

// TestNullAllowDeniesAll: "allow:" with nothing after it (YAML null), "[]"
// and "~" deny every target, and so does a "targets:" block without an
// allow (its list commented out, "targets: {}"): only an omitted targets
// block means the default "*".
func TestNullAllowDeniesAll(t *testing.T) {
	base := strings.Replace(validYAML, "targets:\n  allow: [\"*\"]\n", "", 1)
	for _, tc := range []struct {
		name, targets string
		allowed       bool
		env           []string
	}{
		{"omitted", "", true, nil},
		{"bare", "targets:\n  allow:\n", false, nil},
		{"tilde", "targets:\n  allow: ~\n", false, nil},
		{"empty list", "targets:\n  allow: []\n", false, nil},
		{"star", "targets:\n  allow: [\"*\"]\n", true, nil},
		{"bare targets", "targets:\n", false, nil},
		{"targets with its list commented out", "targets:\n#  allow:\n#    - orders\n", false, nil},
		{"targets tilde", "targets: ~\n", false, nil},
		{"targets empty mapping", "targets: {}\n", false, nil},
		{"allow from env over bare targets", "targets:\n", true, []string{"DELAYBRIDGE_TARGETS_ALLOW=kafka:orders"}},
		{"merged mappings, one without allow", "targets:\n  <<: [{allow: [orders]}, {}]\n", true, nil},
		{"top-level merge", "<<: {targets: {allow: [orders]}}\n", true, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := mustLoad(t, base+tc.targets, tc.env...)
			if got := c.AllowTarget(codec.TransportKafka, "orders"); got != tc.allowed {
				t.Fatalf("AllowTarget(kafka:orders) = %v with %q (allow %q), want %v", got, tc.targets, c.Targets.Allow, tc.allowed)
			}
		})
	}
}

// The default memtable follows a cache_mb under 256 (half of it), so a
// smaller cache alone is valid; a memtable_mb that is set, in the file or
// the environment, is kept and checked.
func TestMemtableDefaultFollowsCache(t *testing.T) {
	runStoreCases(t, "memtable_mb", func(c *Config) int { return c.Store.MemtableMB }, []storeCase{
		{"defaults", "", nil, 128, ""},
		{"large cache", "store: {cache_mb: 2048}\n", nil, 128, ""},
		{"small cache alone", "store: {cache_mb: 100}\n", nil, 50, ""},
		{"small cache from env", "", []string{"DELAYBRIDGE_STORE_CACHE_MB=64"}, 32, ""},
		{"memtable set and fits", "store: {cache_mb: 100, memtable_mb: 20}\n", nil, 20, ""},
		{"memtable set too large", "store: {cache_mb: 100, memtable_mb: 128}\n", nil, 0, "store.memtable_mb: must be between 4 and store.cache_mb/2 (50), got 128"},
		{"memtable from env too large", "store: {cache_mb: 100}\n", []string{"DELAYBRIDGE_STORE_MEMTABLE_MB=128"}, 0, "store.memtable_mb (from DELAYBRIDGE_STORE_MEMTABLE_MB): must be between"},
		{"explicit zero kept and refused", "store: {memtable_mb: 0}\n", nil, 0, "store.memtable_mb: must be between"},
		{"null is omitted", "store: {cache_mb: 100, memtable_mb: null}\n", nil, 50, ""},
	})
}

// storeCase is a store block added to validYAML (and environment
// variables), with the value a key should get or the error it should give.
type storeCase struct {
	name    string
	store   string
	env     []string
	want    int
	wantErr string
}

// runStoreCases loads each case and checks the key get reads.
func runStoreCases(t *testing.T, key string, get func(*Config) int, tests []storeCase) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := LoadBytes([]byte(validYAML+tt.store), tt.env)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := get(c); got != tt.want {
				t.Fatalf("%s %d, want %d", key, got, tt.want)
			}
		})
	}
}

// TestStoreReserveDefault: store.reserve_mb defaults to room for two
// write-ahead logs of the memtable in use (2 × 1.1 × memtable_mb rounded
// up, the memtable's own default included); a value that is set, 0 (no
// reserve) too, is kept, and one out of range is refused by its name.
func TestStoreReserveDefault(t *testing.T) {
	runStoreCases(t, "reserve_mb", func(c *Config) int { return c.Store.ReserveMB }, []storeCase{
		{"defaults", "", nil, 282, ""},
		{"memtable set", "store: {memtable_mb: 16}\n", nil, 36, ""},
		{"memtable from a small cache", "store: {cache_mb: 100}\n", nil, 110, ""},
		{"memtable from env", "", []string{"DELAYBRIDGE_STORE_MEMTABLE_MB=64"}, 141, ""},
		{"set", "store: {reserve_mb: 1024}\n", nil, 1024, ""},
		{"zero is none", "store: {reserve_mb: 0}\n", nil, 0, ""},
		{"from env", "store: {reserve_mb: 1024}\n", []string{"DELAYBRIDGE_STORE_RESERVE_MB=0"}, 0, ""},
		{"negative", "store: {reserve_mb: -1}\n", nil, 0, "store.reserve_mb: must be between 0 (no reserve) and 16777216, got -1"},
		{"negative from env", "", []string{"DELAYBRIDGE_STORE_RESERVE_MB=-5"}, 0, "store.reserve_mb (from DELAYBRIDGE_STORE_RESERVE_MB): must be between"},
	})
	if got := Default().Store.ReserveMB; got != StoreReserveMB(DefaultStoreMemtableMB) || got != 282 {
		t.Errorf("Default().Store.ReserveMB = %d, want 282", got)
	}
}

// TestLoadEmptyTransportBlock: a "kafka:" or "nats:" with nothing under it
// (YAML null) is as if omitted; when that leaves no transport, the error
// names the empty block and what it lacks, not only that no transport is
// configured (hunt H202: "kafka, nats: at least one transport must be
// configured" for a file that has a kafka: block). With another transport
// configured the empty block stays omitted.
func TestLoadEmptyTransportBlock(t *testing.T) {
	const base = "data_dir: /var/lib/delaybridge\nadmin:\n  listen: 127.0.0.1:8080\n"
	natsOnly := "nats:\n  sources:\n    - subject: \"delay.>\"\n      dlq: dlq.delay\n"
	kafkaEmpty := `kafka: empty: nothing under "kafka:" (read as omitted), so no transport is configured; set kafka.brokers (at least one host:port) and kafka.sources`
	natsEmpty := `nats: empty: nothing under "nats:" (read as omitted), so no transport is configured; set nats.sources (at least one delay subject`
	generic := "kafka, nats: at least one transport must be configured"
	for _, tc := range []struct {
		name, yml string
		want      []string // substrings of the error; none: it loads
		not       []string
	}{
		{"kafka bare", base + "kafka:\n", []string{kafkaEmpty}, []string{generic, "nats:"}},
		{"kafka tilde", base + "kafka: ~\n", []string{kafkaEmpty}, []string{generic}},
		{"nats bare", base + "nats:\n", []string{natsEmpty}, []string{generic, "kafka:"}},
		{"both bare", base + "kafka:\nnats:\n", []string{kafkaEmpty, natsEmpty}, []string{generic}},
		{"neither", base, []string{generic}, []string{"empty"}},
		{"kafka empty mapping", base + "kafka: {}\n", []string{"kafka.brokers: required", "kafka.sources: required"}, []string{generic, "kafka: empty"}},
		{"kafka bare beside nats", base + "kafka:\n" + natsOnly, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := LoadBytes([]byte(tc.yml), nil)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("LoadBytes: %v", err)
				}
				if c.Kafka != nil || c.NATS == nil {
					t.Fatalf("kafka %+v, nats %+v: want the empty kafka block omitted", c.Kafka, c.NATS)
				}
				return
			}
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			for _, n := range tc.not {
				if strings.Contains(err.Error(), n) {
					t.Errorf("error %q contains %q", err, n)
				}
			}
		})
	}
}
