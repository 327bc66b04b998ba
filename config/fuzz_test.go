package config

import (
	"strings"
	"testing"

	"github.com/delaybridge/delaybridge/codec"
)

// FuzzLoad feeds arbitrary YAML and one arbitrary environment variable to
// LoadBytes: it must never panic, and a configuration it accepts must
// validate and survive a round trip through its own YAML form.
func FuzzLoad(f *testing.F) {
	f.Add(validYAML, "DELAYBRIDGE_KAFKA_BROKERS=a:1,b:2")
	f.Add(validYAML, "DELAYBRIDGE_KAFKA_SOURCES_3_TOPIC=x")
	f.Add("data_dir: /d\nnats: {sources: [{subject: a.>, dlq: b}]}\n", "DELAYBRIDGE_NATS_URL=nats://x:1")
	f.Add("a: &a [*a]\n", "")
	f.Add("kafka: {<<: *x}\n", "DELAYBRIDGE_=")
	f.Add("- [[[[[\n", "DELAYBRIDGE_ADMIN_TOKEN_FILE=/dev/null")
	f.Add("max_delay: 99999999999999999d\nretry: {multiplier: .nan}\n", "DELAYBRIDGE_RETRY_JITTER=NaN")
	f.Add("targets: {allow: ['[', 'kafka:', '*.>']}\n", "DELAYBRIDGE_TARGETS_ALLOW=a.>,b")
	f.Fuzz(func(t *testing.T, yml, env string) {
		// Secret files could name anything on the test machine; the file
		// reading is covered by TestSecretsFromFiles.
		if strings.Contains(env, "_FILE=") {
			return
		}
		c, err := LoadBytes([]byte(yml), []string{env})
		if err != nil {
			if err.Error() == "" {
				t.Fatal("empty error message")
			}
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("LoadBytes accepted a config Validate refuses: %v", err)
		}
		_ = c.AllowTarget(codec.TransportNATS, "a.b")
		_ = c.String()
	})
}

// FuzzAllowTarget checks that matching never panics and that "*" allows
// every non-empty name.
func FuzzAllowTarget(f *testing.F) {
	for _, s := range [][2]string{{"orders.*", "orders.x"}, {"nats:a.>", "a.b.c"}, {"[a-", "a"}, {`\`, `\`}, {"*?[!]", "x"}} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, pattern, name string) {
		c := &Config{Targets: Targets{Allow: []string{pattern}}}
		_ = checkPattern(pattern)
		_ = c.AllowTarget(codec.TransportKafka, name)
		_ = c.AllowTarget(codec.TransportNATS, name)
		star := &Config{Targets: Targets{Allow: []string{"*"}}}
		if name != "" && !star.AllowTarget(codec.TransportKafka, name) {
			t.Fatalf("* refused %q", name)
		}
		if !strings.ContainsAny(pattern, `*?[]\>:`) && name != "" && c.AllowTarget(codec.TransportKafka, name) != (pattern == name) {
			t.Fatalf("literal pattern %q vs %q", pattern, name)
		}
	})
}
