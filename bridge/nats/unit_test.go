package nats

import (
	"crypto/tls"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	natsgo "github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/delaybridge/delaybridge/codec"
)

func TestSubjectMatch(t *testing.T) {
	tests := []struct {
		filter, subject string
		want            bool
	}{
		{"delay", "delay", true},
		{"delay", "delay.a", false},
		{"delay.a", "delay", false},
		{"delay.*", "delay.a", true},
		{"delay.*", "delay.a.b", false},
		{"delay.*", "delay", false},
		{"delay.>", "delay.a", true},
		{"delay.>", "delay.a.b.c", true},
		{"delay.>", "delay", false},
		{">", "a", true},
		{">", "a.b", true},
		{"*", "a", true},
		{"*", "a.b", false},
		{"*.b.>", "a.b.c", true},
		{"*.b.>", "a.c.c", false},
		{"a.*.c", "a.b.c", true},
		{"a.*.c", "a.b.d", false},
		{"a.b", "a.bc", false},
		{"a.bc", "a.b", false},
		{"a.>", "a..b", false},
		{"a.>", "", false},
	}
	for _, tt := range tests {
		if got := subjectMatch(tt.filter, tt.subject); got != tt.want {
			t.Errorf("subjectMatch(%q, %q) = %v, want %v", tt.filter, tt.subject, got, tt.want)
		}
	}
}

func TestFilterCovers(t *testing.T) {
	tests := []struct {
		super, sub string
		want       bool
	}{
		{"delay.>", "delay.a", true},
		{"delay.>", "delay.*", true},
		{"delay.>", "delay.>", true},
		{"delay.>", "delay", false},
		{"delay.*", "delay.a", true},
		{"delay.*", "delay.>", false},
		{"delay.*", "delay.a.b", false},
		{"delay.a", "delay.*", false},
		{"delay.a", "delay.a", true},
		{">", "anything.>", true},
		{"a.b", "a.b.c", false},
	}
	for _, tt := range tests {
		if got := filterCovers(tt.super, tt.sub); got != tt.want {
			t.Errorf("filterCovers(%q, %q) = %v, want %v", tt.super, tt.sub, got, tt.want)
		}
	}
}

func TestFiltersOverlap(t *testing.T) {
	tests := []struct {
		a, b string
		want bool
	}{
		{"delay.>", "delay.a", true},
		{"delay.a", "delay.>", true},
		{"delay.*", "delay.a", true},
		{"delay.a.*", "delay.*.b", true},
		{"delay.a", "delay.b", false},
		{"delay.*", "delay.a.b", false},
		{"delay.>", "delay", false},
		{">", "x", true},
		{"other.>", "delay.>", false},
		{"a.b", "a.b", true},
		{"a.b", "a.b.c", false},
	}
	for _, tt := range tests {
		if got := filtersOverlap(tt.a, tt.b); got != tt.want {
			t.Errorf("filtersOverlap(%q, %q) = %v, want %v", tt.a, tt.b, got, tt.want)
		}
	}
}

func TestCoveringFilters(t *testing.T) {
	tests := []struct {
		in, want []string
	}{
		{[]string{"delay.>"}, []string{"delay.>"}},
		{[]string{"delay.special.>", "delay.>"}, []string{"delay.>"}},
		{[]string{"a.*", "a.b", "c"}, []string{"a.*", "c"}},
		{[]string{"a.b", "a.b"}, []string{"a.b"}},
		{[]string{"a.*", "a.>", "a.*"}, []string{"a.>"}},
		{[]string{"a.*.c", "a.b.*"}, []string{"a.*.c", "a.b.*"}},
	}
	for _, tt := range tests {
		if got := coveringFilters(tt.in); !reflect.DeepEqual(got, tt.want) {
			t.Errorf("coveringFilters(%v) = %v, want %v", tt.in, got, tt.want)
		}
	}
}

func TestCheckpointKey(t *testing.T) {
	tests := []struct {
		stream   string
		created  int64
		subjects []string
		want     string
	}{
		{"DELAY", 1795359845123456789, []string{"delay.>"}, "nats|DELAY|delay.>|1795359845123456789"},
		{"DELAY", 7, []string{"delay.special.>", "delay.>"}, "nats|DELAY|delay.>|7"},
		{"DELAY", 7, []string{"b.*", "a.*"}, "nats|DELAY|a.*,b.*|7"},
		{"DELAY", 7, []string{"a.*", "b.*"}, "nats|DELAY|a.*,b.*|7"},
	}
	for _, tt := range tests {
		if got := CheckpointKey(tt.stream, tt.created, tt.subjects); got != tt.want {
			t.Errorf("CheckpointKey(%q, %d, %v) = %q, want %q", tt.stream, tt.created, tt.subjects, got, tt.want)
		}
		// What versions before stored: the same without the identity.
		if got, want := baseKey(tt.stream, tt.subjects), tt.want[:strings.LastIndexByte(tt.want, '|')]; got != want {
			t.Errorf("baseKey(%q, %v) = %q, want %q", tt.stream, tt.subjects, got, want)
		}
	}
}

func TestValidFilter(t *testing.T) {
	tests := map[string]bool{
		"delay": true, "delay.>": true, "delay.*.x": true, ">": true, "*": true,
		"": false, "delay.": false, ".delay": false, "a..b": false, "a.>.b": false,
		"a.b*": false, "a.>b": false, "a b": false,
	}
	for f, want := range tests {
		if got := validFilter(f); got != want {
			t.Errorf("validFilter(%q) = %v, want %v", f, got, want)
		}
	}
}

func TestRulesFor(t *testing.T) {
	a, b := &codec.Rules{DLQ: "a"}, &codec.Rules{DLQ: "b"}
	sources := []SourceConfig{{Subject: "delay.special.>", Rules: a}, {Subject: "delay.>", Rules: b}}
	tests := []struct {
		subject string
		want    *codec.Rules
		ok      bool
	}{
		{"delay.special.x", a, true},
		{"delay.x", b, true},
		{"delay.special", b, true},
		{"other.x", nil, false},
	}
	for _, tt := range tests {
		got, ok := rulesFor(sources, tt.subject)
		if got != tt.want || ok != tt.ok {
			t.Errorf("rulesFor(%q) = %v, %v; want %v, %v", tt.subject, got, ok, tt.want, tt.ok)
		}
	}
}

func TestHeadersIn(t *testing.T) {
	tests := []struct {
		name string
		in   natsgo.Header
		want []codec.Header
	}{
		{"nil", nil, nil},
		{"empty", natsgo.Header{}, nil},
		{"single", natsgo.Header{"delay-after": {"5s"}}, []codec.Header{{Key: "delay-after", Value: []byte("5s")}}},
		{
			"multi-valued keeps value order, keys sorted",
			natsgo.Header{"x-b": {"2", "1", "3"}, "Nats-Msg-Id": {"id1"}, "delay-target": {"out"}},
			[]codec.Header{
				{Key: "Nats-Msg-Id", Value: []byte("id1")},
				{Key: "delay-target", Value: []byte("out")},
				{Key: "x-b", Value: []byte("2")}, {Key: "x-b", Value: []byte("1")}, {Key: "x-b", Value: []byte("3")},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := headersIn(tt.in); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestHeadersOut(t *testing.T) {
	tests := []struct {
		name string
		in   []codec.Header
		want natsgo.Header
	}{
		{"none", nil, natsgo.Header{"Nats-Msg-Id": {"ID"}}},
		{
			"repeated keys keep order",
			[]codec.Header{{Key: "x", Value: []byte("1")}, {Key: "y", Value: []byte("a")}, {Key: "x", Value: []byte("2")}},
			natsgo.Header{"x": {"1", "2"}, "y": {"a"}, "Nats-Msg-Id": {"ID"}},
		},
		{
			"publish directives dropped, msg id replaced",
			[]codec.Header{
				{Key: "Nats-Msg-Id", Value: []byte("source-id")},
				{Key: "nats-msg-id", Value: []byte("source-id2")},
				{Key: "Nats-Expected-Last-Sequence", Value: []byte("7")},
				{Key: "Nats-Expected-Stream", Value: []byte("DELAY")},
				{Key: "Nats-TTL", Value: []byte("1m")},
				{Key: "Nats-Rollup", Value: []byte("sub")},
				{Key: "Nats-Schedule", Value: []byte("@at x")},
				{Key: "Nats-Schedule-Target", Value: []byte("x")},
				{Key: "Nats-Batch-Id", Value: []byte("b")},
				{Key: "Nats-Incr", Value: []byte("1")},
				{Key: "Nats-Trace-Dest", Value: []byte("kept")},
				{Key: "Nats-Trace-Only", Value: []byte("true")},
				{Key: "Nats-Required-Api-Level", Value: []byte("1")},
				{Key: "Nats-Stream-Source", Value: []byte("EDGE 1 > >")},
				{Key: "Nats-Stream", Value: []byte("EVENTS")},
				{Key: "Nats-Subject", Value: []byte("events.o")},
				{Key: "Nats-Sequence", Value: []byte("6")},
				{Key: "Nats-Time-Stamp", Value: []byte("2026-11-26T21:00:00Z")},
				{Key: "Nats-Last-Sequence", Value: []byte("5")},
				{Key: "Nats-Msg-Size", Value: []byte("4")},
				{Key: "Nats-Num-Pending", Value: []byte("0")},
				{Key: "Nats-UpTo-Sequence", Value: []byte("6")},
				{Key: "Nats-Streamed", Value: []byte("kept: not a header the server sets")},
				{Key: "delay-id", Value: []byte("kept")},
			},
			natsgo.Header{"delay-id": {"kept"}, "Nats-Streamed": {"kept: not a header the server sets"}, "Nats-Msg-Id": {"ID"}},
		},
		{
			// Kafka allows any header name; NATS does not, and nats.go
			// would refuse the whole message for one of them.
			"names NATS cannot carry are percent-encoded, empty ones dropped",
			[]codec.Header{
				{Key: "trace id", Value: []byte("1")},
				{Key: "a:b", Value: []byte("2")},
				{Key: "", Value: []byte("3")},
				{Key: "x/100%", Value: []byte("4")},
				{Key: "50%", Value: []byte("5")},
				{Key: "é", Value: []byte("6")},
				// Valid as it is, but kept it would be "trace id"'s
				// form: the two would merge into one header.
				{Key: "trace%20id", Value: []byte("7")},
			},
			natsgo.Header{"trace%20id": {"1"}, "a%3Ab": {"2"}, "x%2F100%25": {"4"}, "50%25": {"5"}, "%C3%A9": {"6"}, "trace%2520id": {"7"}, "Nats-Msg-Id": {"ID"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := headersOut(tt.in, "ID", codec.TransportKafka)
			if !headerKeysValid(got) {
				t.Fatalf("%v: not a valid NATS header", got)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func TestRedactURL(t *testing.T) {
	tests := map[string]string{
		"nats://localhost:4222":             "nats://localhost:4222",
		"nats://user:secret@localhost:4222": "nats://localhost:4222",
		"nats://tok@a:1, nats://u:p@b:2":    "nats://a:1,nats://b:2",
		"tls://user:pass@host:4443":         "tls://host:4443",
		"nats://us%er:p@ss@host:1":          "nats://REDACTED@host:1",
		// A "/", "?" or "#" in the credential ends the user information:
		// url.Parse sees no user, and the credential as host or path.
		"nats://secret/dG9rZW4=@host:4222": "nats://REDACTED@host:4222",
		"nats://u:pa?ss@host:1":            "nats://REDACTED@host:1",
		"tls://secret#x@host:1":            "tls://REDACTED@host:1",
		"secret/x@host:1":                  "[url with credentials]",
		"nats://tok@secret/x@host:1":       "nats://REDACTED@host:1",
	}
	for in, want := range tests {
		got := redactURL(in)
		if got != want {
			t.Errorf("redactURL(%q) = %q, want %q", in, got, want)
		}
		if strings.Contains(got, "secret") || strings.Contains(got, "pass") || strings.Contains(got, "pa?ss") || strings.Contains(got, "dG9rZW4") {
			t.Errorf("redactURL(%q) leaks a secret: %q", in, got)
		}
	}
}

// TestOptions builds the connect options and applies them to a nats.go
// Options value to see what a connection would use.
func TestOptions(t *testing.T) {
	dir := t.TempDir()
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	pub, _ := kp.PublicKey()
	seedFile := filepath.Join(dir, "user.nk")
	if err := os.WriteFile(seedFile, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	credsFile := filepath.Join(dir, "user.creds")
	if err := os.WriteFile(credsFile, []byte("placeholder"), 0o600); err != nil {
		t.Fatal(err)
	}
	tlsCfg := &tls.Config{ServerName: "example"}

	tests := []struct {
		name    string
		cfg     Config
		wantErr error
		check   func(t *testing.T, o *natsgo.Options)
	}{
		{
			name: "defaults: reconnect forever, keep trying on auth errors",
			cfg:  Config{},
			check: func(t *testing.T, o *natsgo.Options) {
				if o.MaxReconnect != -1 || !o.IgnoreAuthErrorAbort || o.Name != "delaybridge" {
					t.Errorf("MaxReconnect=%d IgnoreAuthErrorAbort=%v Name=%q", o.MaxReconnect, o.IgnoreAuthErrorAbort, o.Name)
				}
				if o.User != "" || o.Token != "" || o.Nkey != "" || o.UserJWT != nil || o.TLSConfig != nil {
					t.Error("unexpected credentials")
				}
				if o.RetryOnFailedConnect {
					t.Error("a failed first connect must be an error, not a background retry")
				}
			},
		},
		{
			name: "user and password",
			cfg:  Config{User: "bridge", Password: "s3cret"},
			check: func(t *testing.T, o *natsgo.Options) {
				if o.User != "bridge" || o.Password != "s3cret" {
					t.Errorf("user=%q password=%q", o.User, o.Password)
				}
			},
		},
		{
			name: "token",
			cfg:  Config{Token: "tok"},
			check: func(t *testing.T, o *natsgo.Options) {
				if o.Token != "tok" {
					t.Errorf("token=%q", o.Token)
				}
			},
		},
		{
			name: "nkey seed file",
			cfg:  Config{NkeyFile: seedFile},
			check: func(t *testing.T, o *natsgo.Options) {
				if o.Nkey != pub || o.SignatureCB == nil {
					t.Errorf("nkey=%q signer=%v", o.Nkey, o.SignatureCB != nil)
				}
			},
		},
		{
			name: "creds file",
			cfg:  Config{CredsFile: credsFile},
			check: func(t *testing.T, o *natsgo.Options) {
				if o.UserJWT == nil || o.SignatureCB == nil {
					t.Error("creds callbacks not set")
				}
			},
		},
		{
			name: "tls",
			cfg:  Config{TLS: tlsCfg},
			check: func(t *testing.T, o *natsgo.Options) {
				if !o.Secure || o.TLSConfig == nil || o.TLSConfig.ServerName != "example" {
					t.Errorf("secure=%v tls=%v", o.Secure, o.TLSConfig)
				}
			},
		},
		{name: "password without user", cfg: Config{Password: "x"}, wantErr: ErrConfig},
		{name: "user and token", cfg: Config{User: "u", Password: "s3cret", Token: "t0kv4lue"}, wantErr: ErrConfig},
		{name: "token and creds", cfg: Config{Token: "t0kv4lue", CredsFile: credsFile}, wantErr: ErrConfig},
		{name: "missing creds file", cfg: Config{CredsFile: filepath.Join(dir, "nope")}, wantErr: ErrConfig},
		{name: "missing nkey file", cfg: Config{NkeyFile: filepath.Join(dir, "nope")}, wantErr: ErrConfig},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := tt.cfg
			cfg.setDefaults()
			opts, err := cfg.options()
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("err = %v, want %v", err, tt.wantErr)
				}
				if err != nil && (strings.Contains(err.Error(), "s3cret") || strings.Contains(err.Error(), "t0kv4lue")) {
					t.Errorf("error leaks a secret: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			o := natsgo.GetDefaultOptions()
			for _, opt := range opts {
				if err := opt(&o); err != nil {
					t.Fatal(err)
				}
			}
			tt.check(t, &o)
		})
	}
}

func TestValidateSource(t *testing.T) {
	ok := Config{Stream: "DELAY", Consumer: "c", Sources: []SourceConfig{{Subject: "delay.>"}}}
	tests := []struct {
		name string
		mod  func(c *Config)
		ok   bool
	}{
		{"valid", func(*Config) {}, true},
		{"no stream", func(c *Config) { c.Stream = "" }, false},
		{"dotted stream", func(c *Config) { c.Stream = "A.B" }, false},
		{"no consumer", func(c *Config) { c.Consumer = "" }, false},
		{"wildcard consumer", func(c *Config) { c.Consumer = "c*" }, false},
		{"no sources", func(c *Config) { c.Sources = nil }, false},
		{"bad filter", func(c *Config) { c.Sources = []SourceConfig{{Subject: "delay.>.x"}} }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := ok
			tt.mod(&c)
			err := c.validateSource()
			if (err == nil) != tt.ok || (err != nil && !errors.Is(err, ErrConfig)) {
				t.Errorf("validateSource() = %v, want ok=%v", err, tt.ok)
			}
		})
	}
}

// headerKeysValid checks names against NATS's rule (printable ASCII except
// space and the separators nats.go refuses).
func headerKeysValid(h natsgo.Header) bool {
	for k := range h {
		if k == "" || strings.ContainsAny(k, " \"(),/:;<=>?@[\\]{}") {
			return false
		}
		for i := 0; i < len(k); i++ {
			if k[i] <= ' ' || k[i] >= 0x7f {
				return false
			}
		}
	}
	return true
}
