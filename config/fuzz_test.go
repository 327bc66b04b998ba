package config

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/delaybridge/delaybridge/codec"
)

// FuzzLoad feeds arbitrary YAML and one arbitrary environment variable to
// LoadBytes: it must never panic, a configuration it accepts must validate,
// and its printed form (String, secrets redacted) must load back to the same
// redacted configuration.
func FuzzLoad(f *testing.F) {
	f.Add(validYAML, "DELAYBRIDGE_KAFKA_BROKERS=a:1,b:2")
	f.Add(validYAML, "DELAYBRIDGE_KAFKA_SOURCES_3_TOPIC=x")
	f.Add("data_dir: /d\nnats: {sources: [{subject: a.>, dlq: b}]}\n", "DELAYBRIDGE_NATS_URL=nats://x:1")
	f.Add("a: &a [*a]\n", "")
	f.Add("kafka: {<<: *x}\n", "DELAYBRIDGE_=")
	f.Add("- [[[[[\n", "DELAYBRIDGE_ADMIN_TOKEN_FILE=/dev/null")
	f.Add("max_delay: 99999999999999999d\nretry: {multiplier: .nan}\n", "DELAYBRIDGE_RETRY_JITTER=NaN")
	f.Add("targets: {allow: ['[', 'kafka:', '*.>']}\n", "DELAYBRIDGE_TARGETS_ALLOW=a.>,b")
	f.Add("kafka:\n  sources:\n    - &a {topic: t, dlq: d}\n    - {<<: [*a, *a]}\n", "")
	f.Add("retry: &x {<<: *x}\n", "")
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
		// *_file keys would be read again next to the inline secret; YAML
		// writes invalid UTF-8 as !!binary.
		if hasSecretFile(c) || !utf8.ValidString(yml) || !utf8.ValidString(env) {
			return
		}
		back, err := LoadBytes([]byte(c.String()), nil)
		if err != nil {
			t.Fatalf("printed form does not load: %v\n%s", err, c)
		}
		if !reflect.DeepEqual(back, c.Redacted()) {
			t.Fatalf("printed form loads differently:\n%s\nvs\n%s", back, c)
		}
	})
}

func hasSecretFile(c *Config) bool {
	return c.Admin.TokenFile != "" || c.Admin.MetricsTokenFile != "" ||
		(c.Kafka != nil && c.Kafka.SASL.PasswordFile != "") ||
		(c.NATS != nil && (c.NATS.PasswordFile != "" || c.NATS.TokenFile != ""))
}

// FuzzAllowTarget checks that matching never panics and that "*" allows
// every non-empty name.
func FuzzAllowTarget(f *testing.F) {
	for _, s := range [][2]string{{"orders.*", "orders.x"}, {"nats:a.>", "a.b.c"}, {"[a-", "a"}, {`\`, `\`}, {"*?[!]", "x"}, {"*", "_schemas"}, {"?x", "$x"}} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, pattern, name string) {
		c := &Config{Targets: Targets{Allow: []string{pattern}}}
		_ = checkPattern(pattern)
		_ = c.AllowTarget(codec.TransportKafka, name)
		_ = c.AllowTarget(codec.TransportNATS, name)
		star := &Config{Targets: Targets{Allow: []string{"*"}}}
		if name != "" && star.AllowTarget(codec.TransportKafka, name) == strings.HasPrefix(name, "_") {
			t.Fatalf("* on Kafka %q: %v (only names starting with _ are refused)", name, !strings.HasPrefix(name, "_"))
		}
		if checkPattern(pattern) == nil && !strings.ContainsAny(pattern, `*?[]\>:`) && name != "" && c.AllowTarget(codec.TransportKafka, name) != (pattern == name) {
			t.Fatalf("literal pattern %q vs %q", pattern, name)
		}
		// Without classes and ">", the dot-token semantics are path.Match's
		// with "." in the role of "/", for subjects a target may name (no
		// empty token) that are not system subjects (matched only by a
		// pattern naming them).
		subject := name != "" && !strings.HasPrefix(name, ".") && !strings.HasSuffix(name, ".") && !strings.Contains(name, "..") &&
			!systemSubject(codec.TransportNATS, name)
		if checkPattern(pattern) == nil && pattern != "*" && subject && !strings.ContainsAny(pattern, "[]>:/") && !strings.Contains(name, "/") {
			swap := strings.NewReplacer(".", "/")
			want, err := path.Match(swap.Replace(pattern), swap.Replace(name))
			if err == nil && c.AllowTarget(codec.TransportNATS, name) != want {
				t.Fatalf("pattern %q vs %q: got %v, path.Match says %v", pattern, name, !want, want)
			}
		}
	})
}

// FuzzParseSecret feeds the secret file readers (admin.token_file and the
// other *_file keys, tls.ca_file) arbitrary file contents. They never
// panic; a secret is the file without one trailing "\n" or "\r\n" and is
// refused (ErrEmptySecret) only when that leaves nothing; and a bearer
// token they accept reaches the admin server intact: Go's HTTP client
// sends "Authorization: Bearer TOKEN" and the server reads TOKEN back the
// way admin does.
func FuzzParseSecret(f *testing.F) {
	for _, s := range []string{"tok\n", "tok\r\n", "tok", "\n", "\r\n", "", "tok\n\n", " tok", "to k", "to\tk", "tok\x7f", "t\u0085k", "t\xc2", "\xa0tok",
		"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"} {
		f.Add([]byte(s))
	}
	got := make(chan string, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, tok, _ := strings.Cut(r.Header.Get("Authorization"), " ")
		got <- strings.TrimSpace(tok)
	}))
	f.Cleanup(srv.Close)
	client := srv.Client()
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := parseSecret(b)
		want := string(b)
		if strings.HasSuffix(want, "\r\n") {
			want = want[:len(want)-2]
		} else {
			want = strings.TrimSuffix(want, "\n")
		}
		switch {
		case want == "" && !errors.Is(err, ErrEmptySecret):
			t.Fatalf("parseSecret(%q) = %q, %v; want ErrEmptySecret", b, s, err)
		case want != "" && (err != nil || s != want):
			t.Fatalf("parseSecret(%q) = %q, %v; want %q", b, s, err, want)
		}
		if pool, err := parseCAs(b); (pool == nil) == (err == nil) || err != nil && !errors.Is(err, ErrNoPEM) {
			t.Fatalf("parseCAs(%q) = %v, %v", b, pool, err)
		}
		tok, err := parseBearerToken(b)
		if err != nil {
			if !errors.Is(err, ErrEmptySecret) && !errors.Is(err, ErrBadToken) {
				t.Fatalf("parseBearerToken(%q): error %v", b, err)
			}
			return
		}
		if tok != s {
			t.Fatalf("parseBearerToken(%q) = %q, parseSecret %q", b, tok, s)
		}
		req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("token %q accepted, but no request can carry it: %v", tok, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		select {
		case back := <-got:
			if back != tok {
				t.Fatalf("token %q accepted, but the server reads %q", tok, back)
			}
		default:
			t.Fatalf("token %q accepted, but the server refused the request: %s", tok, resp.Status)
		}
	})
}
