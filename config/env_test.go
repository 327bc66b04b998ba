package config

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/delaybridge/delaybridge/codec"
)

func TestEnvOverrides(t *testing.T) {
	tests := []struct {
		name  string
		yml   string
		env   []string
		check func(c *Config) error
	}{
		{
			name: "underscore in top-level key",
			env:  []string{"DELAYBRIDGE_DATA_DIR=/env/dir"},
			check: func(c *Config) error {
				return eq(c.DataDir, "/env/dir")
			},
		},
		{
			name: "list is comma-separated (contract example)",
			env:  []string{"DELAYBRIDGE_KAFKA_BROKERS=a:9092,b:9092"},
			check: func(c *Config) error {
				return eq(c.Kafka.Brokers, []string{"a:9092", "b:9092"})
			},
		},
		{
			name: "list items are trimmed, blanks dropped",
			env:  []string{"DELAYBRIDGE_TARGETS_ALLOW= kafka:orders.* , ,nats:events.>"},
			check: func(c *Config) error {
				return eq(c.Targets.Allow, []string{"kafka:orders.*", "nats:events.>"})
			},
		},
		{
			// A NATS subject may contain a comma: "\," keeps it in the
			// pattern, where it matches a comma; "\\," is an escaped
			// backslash, then a separator.
			name: "list item with an escaped comma",
			env:  []string{`DELAYBRIDGE_TARGETS_ALLOW=nats:orders.a\,b, orders.[\,x] ,kafka:x,nats:y\\,z`},
			check: func(c *Config) error {
				if err := eq(c.Targets.Allow, []string{`nats:orders.a\,b`, `orders.[\,x]`, "kafka:x", `nats:y\\`, "z"}); err != nil {
					return err
				}
				for _, tc := range []struct {
					name string
					want bool
				}{{"orders.a,b", true}, {"orders.a", false}, {"orders.,", true}, {"orders.x", true}, {`y\`, true}} {
					if got := c.AllowTarget(codec.TransportNATS, tc.name); got != tc.want {
						return fmt.Errorf("AllowTarget(nats, %q) = %v, want %v", tc.name, got, tc.want)
					}
				}
				return nil
			},
		},
		{
			name: "three-level key",
			env:  []string{"DELAYBRIDGE_KAFKA_SASL_MECHANISM=PLAIN", "DELAYBRIDGE_KAFKA_SASL_USERNAME=u", "DELAYBRIDGE_KAFKA_SASL_PASSWORD=p"},
			check: func(c *Config) error {
				return eq(c.Kafka.SASL, SASL{Mechanism: "PLAIN", Username: "u", Password: "p"})
			},
		},
		{
			name: "key of a nested block",
			env:  []string{"DELAYBRIDGE_STORE_CACHE_MB=1024", "DELAYBRIDGE_STORE_MEMTABLE_MB=64", "DELAYBRIDGE_STORE_RESERVE_MB=300"},
			check: func(c *Config) error {
				return eq(c.Store, Store{CacheMB: 1024, MemtableMB: 64, ReserveMB: 300})
			},
		},
		{
			name: "key with three underscores",
			env:  []string{"DELAYBRIDGE_ADMIN_ALLOW_INSECURE_LISTEN=true", "DELAYBRIDGE_ADMIN_LISTEN=0.0.0.0:8080", "DELAYBRIDGE_ADMIN_PPROF=true"},
			check: func(c *Config) error {
				return eq(c.Admin, Admin{Listen: "0.0.0.0:8080", AllowInsecureListen: true, Pprof: true})
			},
		},
		{
			name: "key that extends another key (token vs token_file)",
			env:  []string{"DELAYBRIDGE_NATS_TOKEN=t", "DELAYBRIDGE_KAFKA_TLS_INSECURE_SKIP_VERIFY=1", "DELAYBRIDGE_KAFKA_TLS_ENABLED=true"},
			check: func(c *Config) error {
				if err := eq(c.NATS.Token.Value(), "t"); err != nil {
					return err
				}
				return eq(c.Kafka.TLS, TLS{Enabled: true, InsecureSkipVerify: true})
			},
		},
		{
			name: "list of blocks by index",
			env:  []string{"DELAYBRIDGE_KAFKA_SOURCES_0_TOPIC=t0", "DELAYBRIDGE_KAFKA_SOURCES_0_DEFAULT_TARGET=orders"},
			check: func(c *Config) error {
				return eq(c.Kafka.Sources, []KafkaSource{{Topic: "t0", DLQ: "delay.dlq", DefaultTarget: "orders"}})
			},
		},
		{
			name: "list of blocks grows by index",
			env:  []string{"DELAYBRIDGE_KAFKA_SOURCES_1_TOPIC=t1", "DELAYBRIDGE_KAFKA_SOURCES_1_DLQ=t1.dlq"},
			check: func(c *Config) error {
				return eq(c.Kafka.Sources, []KafkaSource{{Topic: "delay", DLQ: "delay.dlq"}, {Topic: "t1", DLQ: "t1.dlq"}})
			},
		},
		{
			name: "durations, numbers, days",
			env: []string{"DELAYBRIDGE_MAX_DELAY=2d12h", "DELAYBRIDGE_SHARDS=3", "DELAYBRIDGE_RETRY_JITTER=0",
				"DELAYBRIDGE_RETRY_MAX_ATTEMPTS=4", "DELAYBRIDGE_CANCEL_RETENTION=1d"},
			check: func(c *Config) error {
				return eq([]any{c.MaxDelay.Std(), c.Shards, c.Retry.Jitter, c.Retry.MaxAttempts, c.CancelRetention.Std()},
					[]any{60 * time.Hour, 3, 0.0, 4, 24 * time.Hour})
			},
		},
		{
			name: "env enables an omitted block",
			yml:  "data_dir: /d\nkafka: {brokers: [k:1], sources: [{topic: t, dlq: d}]}\n",
			env: []string{"DELAYBRIDGE_NATS_URL=nats://n:4222",
				"DELAYBRIDGE_NATS_SOURCES_0_SUBJECT=delay.>", "DELAYBRIDGE_NATS_SOURCES_0_DLQ=dlq.x"},
			check: func(c *Config) error {
				if c.NATS == nil {
					return fmt.Errorf("nats not enabled")
				}
				return eq(*c.NATS, NATS{URL: "nats://n:4222", Stream: DefaultNATSStream, Consumer: DefaultNATSConsumer,
					Sources: []NATSSource{{Subject: "delay.>", DLQ: "dlq.x"}}})
			},
		},
		{
			name: "nats.core_targets",
			env:  []string{"DELAYBRIDGE_NATS_CORE_TARGETS=true"},
			check: func(c *Config) error {
				return eq(c.NATS.CoreTargets, true)
			},
		},
		{
			name: "env overrides YAML",
			yml:  validYAML + "shards: 2\n",
			env:  []string{"DELAYBRIDGE_SHARDS=5"},
			check: func(c *Config) error {
				return eq(c.Shards, 5)
			},
		},
		{
			name: "first of duplicate variables wins, as os.Getenv",
			env:  []string{"DELAYBRIDGE_SHARDS=5", "DELAYBRIDGE_SHARDS=6"},
			check: func(c *Config) error {
				return eq(c.Shards, 5)
			},
		},
		{
			name: "other variables are ignored",
			env:  []string{"PATH=/bin", "delaybridge_shards=9", "DELAYBRIDGEX=1", "NOEQUALS"},
			check: func(c *Config) error {
				return eq(c.Shards, DefaultShards)
			},
		},
		{
			name: "empty value empties a list",
			env:  []string{"DELAYBRIDGE_TARGETS_ALLOW="},
			check: func(c *Config) error {
				return eq(c.Targets.Allow, []string{})
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			yml := tt.yml
			if yml == "" {
				yml = validYAML
			}
			c := mustLoad(t, yml, tt.env...)
			if err := tt.check(c); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func eq(got, want any) error {
	if !reflect.DeepEqual(got, want) {
		return fmt.Errorf("got %#v, want %#v", got, want)
	}
	return nil
}

func TestEnvErrors(t *testing.T) {
	tests := []struct {
		name string
		env  []string
		want []string
	}{
		{"unknown key", []string{"DELAYBRIDGE_NOPE=1"}, []string{"env DELAYBRIDGE_NOPE: names no configuration key"}},
		{"unknown nested key", []string{"DELAYBRIDGE_KAFKA_BROKER=a:1"}, []string{"env DELAYBRIDGE_KAFKA_BROKER: names no"}},
		{"block, not key", []string{"DELAYBRIDGE_KAFKA=1"}, []string{"env DELAYBRIDGE_KAFKA: names no"}},
		{"prefix only", []string{"DELAYBRIDGE_=1"}, []string{"env DELAYBRIDGE_: names no"}},
		{"lower case", []string{"DELAYBRIDGE_data_dir=/x"}, []string{"env DELAYBRIDGE_data_dir: names no"}},
		{"list of blocks as one value", []string{"DELAYBRIDGE_KAFKA_SOURCES=delay"}, []string{"DELAYBRIDGE_KAFKA_SOURCES: names no"}},
		// An index after a list of names (the way lists of blocks take
		// theirs) says how that list is set.
		{"index into a list of names", []string{"DELAYBRIDGE_KAFKA_BROKERS_0=a:1"}, []string{"env DELAYBRIDGE_KAFKA_BROKERS_0: names no configuration key; kafka.brokers is a list of names: set it in one variable, comma-separated (DELAYBRIDGE_KAFKA_BROKERS=a,b)"}},
		{"index into targets.allow", []string{"DELAYBRIDGE_TARGETS_ALLOW_1=orders.*"}, []string{"targets.allow is a list of names: set it in one variable, comma-separated (DELAYBRIDGE_TARGETS_ALLOW=a,b)"}},
		{"index without key", []string{"DELAYBRIDGE_KAFKA_SOURCES_0=x"}, []string{"DELAYBRIDGE_KAFKA_SOURCES_0: names no"}},
		{"index leading zero", []string{"DELAYBRIDGE_KAFKA_SOURCES_00_TOPIC=x"}, []string{"names no"}},
		{"index negative", []string{"DELAYBRIDGE_KAFKA_SOURCES_-1_TOPIC=x"}, []string{"names no"}},
		{"index too large", []string{"DELAYBRIDGE_KAFKA_SOURCES_99999999_TOPIC=x"}, []string{"DELAYBRIDGE_KAFKA_SOURCES_99999999_TOPIC (kafka.sources[99999999].topic): index"}},
		{"bad value names key", []string{"DELAYBRIDGE_SHARDS=lots"}, []string{`env DELAYBRIDGE_SHARDS (shards): invalid integer "lots"`}},
		{"bad duration", []string{"DELAYBRIDGE_RETRY_MAX=soon"}, []string{"env DELAYBRIDGE_RETRY_MAX (retry.max): invalid duration"}},
		{"bad bool", []string{"DELAYBRIDGE_NATS_CREATE=yes please"}, []string{"(nats.create): invalid boolean"}},
		{"bad bool core_targets", []string{"DELAYBRIDGE_NATS_CORE_TARGETS=maybe"}, []string{"env DELAYBRIDGE_NATS_CORE_TARGETS (nats.core_targets): invalid boolean"}},
		{"all reported", []string{"DELAYBRIDGE_A=1", "DELAYBRIDGE_B=2"}, []string{"DELAYBRIDGE_A:", "DELAYBRIDGE_B:"}},
		{"gap in list is a validation error", []string{"DELAYBRIDGE_KAFKA_SOURCES_2_TOPIC=t2", "DELAYBRIDGE_KAFKA_SOURCES_2_DLQ=t2.dlq"},
			[]string{"kafka.sources[1].topic (in kafka.sources[1], a list item added by DELAYBRIDGE_KAFKA_SOURCES_2_DLQ: items are numbered from 0",
				"kafka.sources[1].dlq (in kafka.sources[1], a list item added by DELAYBRIDGE_KAFKA_SOURCES_2_DLQ"}},
		{"key missing from an item a variable added", []string{"DELAYBRIDGE_KAFKA_SOURCES_1_TOPIC=t1"},
			[]string{"kafka.sources[1].dlq (in kafka.sources[1], a list item added by DELAYBRIDGE_KAFKA_SOURCES_1_TOPIC"}},
		// A value that parses but fails validation names the variable, as
		// the operator will not find it in the YAML file.
		{"invalid value names the variable", []string{"DELAYBRIDGE_RETRY_MAX_ATTEMPTS=-1"},
			[]string{"retry.max_attempts (from DELAYBRIDGE_RETRY_MAX_ATTEMPTS): must be at least 1, got -1"}},
		{"empty required value names the variable", []string{"DELAYBRIDGE_KAFKA_SOURCES_0_DLQ="},
			[]string{"kafka.sources[0].dlq (from DELAYBRIDGE_KAFKA_SOURCES_0_DLQ): required"}},
		{"list value names the variable", []string{"DELAYBRIDGE_KAFKA_BROKERS=nohost"},
			[]string{"(from DELAYBRIDGE_KAFKA_BROKERS)"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := LoadBytes([]byte(validYAML), tt.env)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

// Every key of the schema has exactly one environment name and that name
// resolves back to the key, so no two keys collide after joining with "_".
func TestEnvNamesRoundTrip(t *testing.T) {
	paths := leafPaths(reflect.TypeFor[Config](), "")
	if len(paths) < 50 {
		t.Fatalf("only %d leaf keys found", len(paths))
	}
	seen := map[string]string{}
	for _, p := range paths {
		name := EnvName(p)
		if prev, dup := seen[name]; dup {
			t.Fatalf("%s and %s share %s", prev, p, name)
		}
		seen[name] = p
		steps, ok := resolveEnv(reflect.TypeFor[Config](), strings.TrimPrefix(name, EnvPrefix))
		if !ok {
			t.Errorf("%s (%s) does not resolve", name, p)
			continue
		}
		if got := stepsPath(steps); got != p {
			t.Errorf("%s resolves to %s, want %s", name, got, p)
		}
	}
}

// leafPaths lists every settable key, with index 0 for lists of blocks.
func leafPaths(t reflect.Type, prefix string) []string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	var out []string
	for i := range t.NumField() {
		name := yamlName(t.Field(i))
		p := join(prefix, name)
		ft := t.Field(i).Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch {
		case ft.Kind() == reflect.Struct:
			out = append(out, leafPaths(ft, p)...)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
			out = append(out, leafPaths(ft.Elem(), p+"[0]")...)
		default:
			out = append(out, p)
		}
	}
	return out
}

func TestEnvName(t *testing.T) {
	for path, want := range map[string]string{
		"data_dir":               "DELAYBRIDGE_DATA_DIR",
		"kafka.brokers":          "DELAYBRIDGE_KAFKA_BROKERS",
		"kafka.sources[0].topic": "DELAYBRIDGE_KAFKA_SOURCES_0_TOPIC",
		"kafka.sasl.password":    "DELAYBRIDGE_KAFKA_SASL_PASSWORD",
	} {
		if got := EnvName(path); got != want {
			t.Errorf("EnvName(%q) = %q, want %q", path, got, want)
		}
	}
}
