package kafka

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// deliverAndConsume proves a working connection end to end: the sink
// publishes one record and the source reads it back.
func deliverAndConsume(t *testing.T, cfg Config) {
	t.Helper()
	sink, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	value := t.Name() // earlier subtests share the topic
	if errs := sink.Deliver(context.Background(), []*codec.Task{task("delay", "k", value)}); errs != nil {
		t.Fatalf("Deliver: %v", errs)
	}
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	stop := runSource(t, src, h)
	waitFor(t, "the record", func() bool {
		return slices.ContainsFunc(h.snapshot(), func(m codec.Message) bool { return string(m.Value) == value })
	})
	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}

// runFails runs a source and expects Run to return an error wrapping want
// instead of retrying forever.
func runFails(t *testing.T, cfg Config, want error) {
	t.Helper()
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = src.Run(ctx, newMemHandler())
	if !errors.Is(err, want) {
		t.Fatalf("Run = %v, want %v", err, want)
	}
	_ = src.Close()
}

func TestSASL(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.EnableSASL(),
		kfake.Superuser("PLAIN", "plain-user", "plain-pass"),
		kfake.Superuser("SCRAM-SHA-256", "scram256", "pass-256"),
		kfake.Superuser("SCRAM-SHA-512", "scram512", "pass-512"),
	)
	for _, tc := range []struct {
		mech, user, pass string
		ok               bool
	}{
		{"PLAIN", "plain-user", "plain-pass", true},
		{"PLAIN", "plain-user", "wrong", false},
		{"SCRAM-SHA-256", "scram256", "pass-256", true},
		{"SCRAM-SHA-256", "scram256", "wrong", false},
		{"scram-sha-512", "scram512", "pass-512", true},
		{"SCRAM-SHA-512", "scram512", "wrong", false},
		{"SCRAM-SHA-512", "nobody", "pass-512", false},
	} {
		t.Run(tc.mech+"/"+tc.user+"/"+tc.pass, func(t *testing.T) {
			mech, err := SASLMechanism(tc.mech, tc.user, tc.pass)
			if err != nil {
				t.Fatal(err)
			}
			cfg := testConfig(t, c.ListenAddrs(), "g-"+tc.user+"-"+tc.pass, "delay")
			cfg.SASL = mech
			src, err := NewSource(cfg)
			if err != nil {
				t.Fatal(err)
			}
			err = src.Check(context.Background())
			if tc.ok {
				if err != nil {
					t.Fatalf("Check: %v", err)
				}
				deliverAndConsume(t, cfg)
				return
			}
			if !errors.Is(err, ErrAuth) {
				t.Fatalf("Check = %v, want ErrAuth", err)
			}
			if strings.Contains(err.Error(), tc.pass) {
				t.Fatalf("error shows the password: %v", err)
			}
			runFails(t, cfg, ErrAuth)
		})
	}
}

func TestSASLMechanismConfig(t *testing.T) {
	for _, tc := range []struct {
		mech, user string
		wantName   string // "" = nil mechanism
		wantErr    bool
	}{
		{"", "", "", false},
		{"PLAIN", "u", "PLAIN", false},
		{"plain", "u", "PLAIN", false},
		{"SCRAM-SHA-256", "u", "SCRAM-SHA-256", false},
		{"SCRAM-SHA-512", "u", "SCRAM-SHA-512", false},
		{"GSSAPI", "u", "", true},
		{"OAUTHBEARER", "u", "", true},
		{"PLAIN", "", "", true},
	} {
		m, err := SASLMechanism(tc.mech, tc.user, "secret-password")
		if (err != nil) != tc.wantErr {
			t.Errorf("%q: err %v, want error %v", tc.mech, err, tc.wantErr)
			continue
		}
		if err != nil {
			if !errors.Is(err, ErrConfig) || strings.Contains(err.Error(), "secret-password") {
				t.Errorf("%q: error %v: want ErrConfig without the password", tc.mech, err)
			}
			continue
		}
		if tc.wantName == "" {
			if m != nil {
				t.Errorf("%q: mechanism %v, want nil", tc.mech, m)
			}
			continue
		}
		if m.Name() != tc.wantName {
			t.Errorf("%q: name %q, want %q", tc.mech, m.Name(), tc.wantName)
		}
	}
}

// pki is a throwaway CA with a server certificate for 127.0.0.1 and a
// client certificate, written as PEM files.
type pki struct {
	dir                   string
	caFile                string
	serverCert            tls.Certificate
	clientCert, clientKey string
	caPool                *x509.CertPool
	otherCAFile           string
	serverName, wrongName string
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	dir := t.TempDir()
	p := &pki{dir: dir, serverName: "broker.test", wrongName: "elsewhere.test"}
	ca := testcert.NewCA(t, "test CA")
	p.caFile = writeFile(t, dir, "ca.pem", ca.CertPEM())
	p.caPool = ca.Pool
	p.otherCAFile = writeFile(t, dir, "other-ca.pem", testcert.NewCA(t, "other CA").CertPEM())
	p.serverCert = ca.Issue(t, "broker", x509.ExtKeyUsageServerAuth, p.serverName, "127.0.0.1").TLS()
	cli := ca.Issue(t, "bridge", x509.ExtKeyUsageClientAuth)
	p.clientCert = writeFile(t, dir, "client.pem", cli.CertPEM())
	p.clientKey = writeFile(t, dir, "client-key.pem", cli.KeyPEM(t))
	return p
}

func writeFile(t *testing.T, dir, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestTLS(t *testing.T) {
	p := newPKI(t)
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.TLS(&tls.Config{
		Certificates: []tls.Certificate{p.serverCert},
		ClientCAs:    p.caPool,
		ClientAuth:   tls.VerifyClientCertIfGiven,
		MinVersion:   tls.VersionTLS12,
	}))
	for _, tc := range []struct {
		name                     string
		ca, cert, key, serverNam string
		want                     error // nil = works
	}{
		{name: "trusted CA", ca: p.caFile},
		{name: "trusted CA with client cert", ca: p.caFile, cert: p.clientCert, key: p.clientKey},
		{name: "server name override", ca: p.caFile, serverNam: p.serverName},
		{name: "unknown CA", ca: p.otherCAFile, want: ErrTLS},
		{name: "wrong server name", ca: p.caFile, serverNam: p.wrongName, want: ErrTLS},
	} {
		// fixed: one tls.Config for every connection (kafka-go's own
		// TLS handshake); per connection: Config.NewTLS (the service's
		// way, so a rotated CA file is read again), whose handshake is
		// dialTLS's.
		for _, perConn := range []bool{false, true} {
			name := tc.name + "/fixed"
			if perConn {
				name = tc.name + "/per connection"
			}
			t.Run(name, func(t *testing.T) {
				cfg := testConfig(t, c.ListenAddrs(), "g-"+strings.ReplaceAll(name, " ", "-"), "delay")
				if perConn {
					ct, err := config.TLS{Enabled: true, CAFile: tc.ca, CertFile: tc.cert, KeyFile: tc.key, ServerName: tc.serverNam}.Client(nil)
					if err != nil {
						t.Fatal(err)
					}
					cfg.NewTLS = ct.Config
				} else {
					tlsCfg, err := TLSConfig(tc.ca, tc.cert, tc.key, tc.serverNam, false)
					if err != nil {
						t.Fatal(err)
					}
					cfg.TLS = tlsCfg
				}
				checkTLSCase(t, cfg, tc.want)
			})
		}
	}

	t.Run("plaintext client", func(t *testing.T) {
		cfg := testConfig(t, c.ListenAddrs(), "g-plain", "delay")
		cfg.DialTimeout = time.Second
		src, err := NewSource(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := src.Check(context.Background()); err == nil {
			t.Fatal("plaintext Check against a TLS broker succeeded")
		}
	})
}

// checkTLSCase checks that cfg's sink and source work (want nil) or fail
// with want, at the check and in Run.
func checkTLSCase(t *testing.T, cfg Config, want error) {
	t.Helper()
	sink, err := NewSink(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	err = sink.Check(context.Background())
	if want == nil {
		if err != nil {
			t.Fatalf("Check: %v", err)
		}
		deliverAndConsume(t, cfg)
		return
	}
	if !errors.Is(err, want) {
		t.Fatalf("Check = %v, want %v", err, want)
	}
	runFails(t, cfg, want)
}

func TestMutualTLSRequired(t *testing.T) {
	p := newPKI(t)
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.TLS(&tls.Config{
		Certificates: []tls.Certificate{p.serverCert},
		ClientCAs:    p.caPool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		MinVersion:   tls.VersionTLS12,
	}))
	noCert, err := TLSConfig(p.caFile, "", "", "", false)
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	cfg.TLS = noCert
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Check(context.Background()); !errors.Is(err, ErrTLS) {
		t.Fatalf("Check without client certificate = %v, want ErrTLS", err)
	}
	runFails(t, cfg, ErrTLS)

	withCert, err := TLSConfig(p.caFile, p.clientCert, p.clientKey, "", false)
	if err != nil {
		t.Fatal(err)
	}
	cfg.TLS = withCert
	deliverAndConsume(t, cfg)
}

func TestTLSConfigFiles(t *testing.T) {
	p := newPKI(t)
	garbage := filepath.Join(p.dir, "garbage.pem")
	if err := os.WriteFile(garbage, []byte("not pem"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name                 string
		ca, cert, key, sname string
		insecure             bool
		wantErr              bool
		check                func(*tls.Config) bool
	}{
		{name: "system roots", check: func(c *tls.Config) bool { return c.RootCAs == nil && len(c.Certificates) == 0 }},
		{name: "ca", ca: p.caFile, check: func(c *tls.Config) bool { return c.RootCAs != nil }},
		{name: "client pair", ca: p.caFile, cert: p.clientCert, key: p.clientKey, check: func(c *tls.Config) bool { return len(c.Certificates) == 1 }},
		{name: "server name", sname: "x.test", check: func(c *tls.Config) bool { return c.ServerName == "x.test" }},
		{name: "insecure", insecure: true, check: func(c *tls.Config) bool { return c.InsecureSkipVerify }},
		{name: "min version", check: func(c *tls.Config) bool { return c.MinVersion == tls.VersionTLS12 }},
		{name: "missing ca", ca: filepath.Join(p.dir, "nope.pem"), wantErr: true},
		{name: "garbage ca", ca: garbage, wantErr: true},
		{name: "cert without key", cert: p.clientCert, wantErr: true},
		{name: "key without cert", key: p.clientKey, wantErr: true},
		{name: "mismatched pair", cert: p.clientCert, key: garbage, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := TLSConfig(tc.ca, tc.cert, tc.key, tc.sname, tc.insecure)
			if tc.wantErr {
				if !errors.Is(err, ErrConfig) {
					t.Fatalf("err %v, want ErrConfig", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tc.check(c) {
				t.Fatalf("unexpected config %+v", c)
			}
		})
	}
}

// With no broker answering, Run keeps retrying and Health says why; it
// returns nil on cancel.
func TestSourceHealthWhileUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // nothing listens there now

	cfg := testConfig(t, []string{addr}, "g", "delay")
	cfg.DialTimeout = 200 * time.Millisecond
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Health(); err != nil {
		t.Fatalf("Health before Run: %v", err)
	}
	if err := src.Check(context.Background()); !errors.Is(err, ErrUnreachable) {
		t.Fatalf("Check = %v, want ErrUnreachable", err)
	}
	stop := runSource(t, src, newMemHandler())
	waitFor(t, "unhealthy", func() bool { return src.Health() != nil })
	if err := src.Health(); !strings.Contains(err.Error(), addr) {
		t.Errorf("Health = %v: want the cause with the address", err)
	}
	if err := stop(); err != nil {
		t.Fatalf("Run after cancel: %v", err)
	}
}

// Health turns bad when the broker goes away under a running source and
// good again when the group is rejoined.
func TestSourceHealthRecovers(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	stop := runSource(t, src, h)
	produce(t, producer(t, c), &kgo.Record{Topic: "delay", Value: []byte("x")})
	waitFor(t, "consumed", func() bool { return h.count() == 1 })
	if err := src.Health(); err != nil {
		t.Fatalf("Health while consuming: %v", err)
	}
	fault := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Fetch}, Topic: "delay", Err: kerr.UnknownServerError, Count: -1})
	waitFor(t, "unhealthy", func() bool { return src.Health() != nil })
	produce(t, producer(t, c), &kgo.Record{Topic: "delay", Value: []byte("during the fault")})
	fault.Remove()
	waitFor(t, "healthy", func() bool { return src.Health() == nil })
	waitFor(t, "the record written during the fault", func() bool { return h.count() == 2 })
	waitFor(t, "commit 2", func() bool { return committed(c, "g", "delay")[0] == 2 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

// A missing delay topic makes the source unhealthy, naming the topic,
// while the topics that exist are read; once it exists, the source joins
// again with every topic and is healthy.
func TestSourceWaitsForMissingTopic(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	src, err := NewSource(testConfig(t, c.ListenAddrs(), "g", "delay", "later"))
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Check(context.Background()); !errors.Is(err, ErrTopicMissing) || !strings.Contains(err.Error(), "later") {
		t.Fatalf("Check = %v, want ErrTopicMissing naming the topic", err)
	}
	h := newMemHandler()
	stop := runSource(t, src, h)
	waitFor(t, "unhealthy", func() bool { return src.Health() != nil })
	if err := src.Health(); !errors.Is(err, ErrTopicMissing) || !strings.Contains(err.Error(), "later") {
		t.Fatalf("Health = %v, want ErrTopicMissing naming the topic", err)
	}
	// The topic that exists is read meanwhile.
	produce(t, producer(t, c), &kgo.Record{Topic: "delay", Value: []byte("w")})
	waitFor(t, "the existing topic consumed while the other is missing", func() bool { return h.count() == 1 })
	if err := src.Health(); !errors.Is(err, ErrTopicMissing) {
		t.Fatalf("Health while later is missing = %v, want ErrTopicMissing", err)
	}
	if err := c.CreateTopic("later", 1, nil); err != nil {
		t.Fatal(err)
	}
	produce(t, producer(t, c), &kgo.Record{Topic: "later", Value: []byte("x")}, &kgo.Record{Topic: "delay", Value: []byte("y")})
	waitFor(t, "both topics consumed", func() bool { return h.count() == 3 })
	if err := src.Health(); err != nil {
		t.Fatalf("Health after the topic appeared: %v", err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
}

func TestConfigValidate(t *testing.T) {
	ok := func() Config {
		return Config{Brokers: []string{"localhost:9092"}, Group: "g", Sources: []SourceConfig{{Topic: "delay"}}}
	}
	for _, tc := range []struct {
		name   string
		mutate func(*Config)
		sink   bool // sink errors too
	}{
		{name: "no brokers", mutate: func(c *Config) { c.Brokers = nil }, sink: true},
		{name: "broker without port", mutate: func(c *Config) { c.Brokers = []string{"localhost"} }, sink: true},
		{name: "no group", mutate: func(c *Config) { c.Group = "" }},
		{name: "no sources", mutate: func(c *Config) { c.Sources = nil }},
		{name: "empty topic", mutate: func(c *Config) { c.Sources = []SourceConfig{{Topic: ""}} }},
		{name: "duplicate topic", mutate: func(c *Config) { c.Sources = append(c.Sources, SourceConfig{Topic: "delay"}) }},
		{name: "retry max below min", mutate: func(c *Config) { c.RetryMin, c.RetryMax = time.Second, time.Millisecond }, sink: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := ok()
			tc.mutate(&cfg)
			if _, err := NewSource(cfg); !errors.Is(err, ErrConfig) {
				t.Errorf("NewSource: %v, want ErrConfig", err)
			}
			_, err := NewSink(cfg)
			if tc.sink != (err != nil) {
				t.Errorf("NewSink: %v, want error %v", err, tc.sink)
			}
		})
	}
	if _, err := NewSource(ok()); err != nil {
		t.Fatal(err)
	}
}

// A user that may read the topic but not use the group is refused at the
// join, which Run reports instead of retrying forever.
func TestGroupAuthorizationFailsRun(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"), kfake.EnableSASL(), kfake.EnableACLs(),
		kfake.Superuser("PLAIN", "admin", "admin"),
		kfake.User("PLAIN", "reader", "pw",
			kfake.ACL{Resource: kmsg.ACLResourceTypeTopic, Name: "delay", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true},
			kfake.ACL{Resource: kmsg.ACLResourceTypeGroup, Name: "allowed", Pattern: kmsg.ACLResourcePatternTypeLiteral, Operation: kmsg.ACLOperationAll, Allow: true},
		))
	mech, err := SASLMechanism("PLAIN", "reader", "pw")
	if err != nil {
		t.Fatal(err)
	}
	cfg := testConfig(t, c.ListenAddrs(), "forbidden", "delay")
	cfg.SASL = mech
	src, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := src.Check(context.Background()); err != nil {
		t.Fatalf("Check (topic access is allowed): %v", err)
	}
	runFails(t, cfg, ErrAuth)

	cfg.Group = "allowed"
	deliverAndConsume(t, cfg)
}

func TestSourceLifecycle(t *testing.T) {
	c := newCluster(t, kfake.SeedTopics(1, "delay"))
	cfg := testConfig(t, c.ListenAddrs(), "g", "delay")

	// Close without Run, then Run: refused.
	s1, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := s1.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s1.Run(context.Background(), newMemHandler()); !errors.Is(err, ErrClosed) {
		t.Fatalf("Run after Close = %v, want ErrClosed", err)
	}

	// A second Run while one is running is refused; Close stops the first.
	s2, err := NewSource(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h := newMemHandler()
	errc := make(chan error, 1)
	go func() { errc <- s2.Run(context.Background(), h) }()
	waitFor(t, "group joined", func() bool {
		gi := c.GroupInfo("g")
		return gi != nil && gi.State == "Stable" && len(gi.Members) == 1
	})
	if err := s2.Run(context.Background(), h); !errors.Is(err, ErrRunning) {
		t.Fatalf("second Run = %v, want ErrRunning", err)
	}
	if err := s2.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatalf("Run after Close = %v, want nil", err)
	}
	waitFor(t, "member left", func() bool {
		gi := c.GroupInfo("g")
		return gi != nil && len(gi.Members) == 0
	})
}
