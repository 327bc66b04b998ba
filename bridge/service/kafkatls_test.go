package service

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math"
	"math/big"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/clock"
	"github.com/delaybridge/delaybridge/internal/testcert"
)

// cutListener is a broker's listener that can close the connections it
// accepted: all of them (a broker restart, a load balancer's reset), or
// those older than an age, as a broker with connections.max.reauth.ms
// closes a session that expired on a client that does not re-authenticate
// (KIP-368: kafka-go's SaslAuthenticate is v0).
type cutListener struct {
	net.Listener
	mu       sync.Mutex
	conns    map[net.Conn]time.Time
	accepted atomic.Int64
}

func (l *cutListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.accepted.Add(1)
		l.mu.Lock()
		l.conns[c] = time.Now()
		l.mu.Unlock()
	}
	return c, err
}

// cut closes the connections accepted more than age ago and returns how
// many.
func (l *cutListener) cut(age time.Duration) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for c, at := range l.conns {
		if time.Since(at) >= age {
			c.Close()
			delete(l.conns, c)
			n++
		}
	}
	return n
}

// cutBrokers is a kfake cluster's listeners, cut together.
type cutBrokers struct {
	mu  sync.Mutex
	lis []*cutListener
}

func (b *cutBrokers) listen(network, address string) (net.Listener, error) {
	l, err := net.Listen(network, address)
	if err != nil {
		return nil, err
	}
	cl := &cutListener{Listener: l, conns: map[net.Conn]time.Time{}}
	b.mu.Lock()
	b.lis = append(b.lis, cl)
	b.mu.Unlock()
	return cl, nil
}

func (b *cutBrokers) cut(age time.Duration) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for _, l := range b.lis {
		n += l.cut(age)
	}
	return n
}

func (b *cutBrokers) accepted() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	var n int64
	for _, l := range b.lis {
		n += l.accepted.Load()
	}
	return n
}

// issueUntil is ca.Issue of a client certificate valid until notAfter.
func issueUntil(t *testing.T, ca *testcert.CA, name string, notAfter time.Time) testcert.Leaf {
	t.Helper()
	key := testcert.NewCA(t, "throwaway").Key // an ECDSA P-256 key
	serial, err := rand.Int(rand.Reader, big.NewInt(math.MaxInt64))
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	return testcert.Leaf{DER: der, Key: key}
}

// kafkaTLSRig is a Kafka-only bridge on a one-broker kfake cluster over
// TLS whose server side the test changes while the bridge runs: the
// certificate it presents, the client certificates it refuses, its clock
// (for client certificate expiry) and its open connections.
type kafkaTLSRig struct {
	t       *testing.T
	kc      *kfake.Cluster
	brokers *cutBrokers
	srvCert atomic.Pointer[tls.Certificate]
	skew    atomic.Int64 // added to the broker's clock
	deny    sync.Map     // serial (string) of client certificates refused
	seen    sync.Map     // CN of client certificates presented -> count
	cl      *kgo.Client  // the test's publisher and consumer
	clk     *clock.Fake
	svc     *Service
	done    <-chan error
	logs    *observer.ObservedLogs
	got     map[string]int
}

func newKafkaTLSRig(t *testing.T, srv tls.Certificate, clientCAs *x509.CertPool) *kafkaTLSRig {
	r := &kafkaTLSRig{t: t, brokers: &cutBrokers{}, clk: clock.NewFake(time.Now()), got: map[string]int{}}
	r.srvCert.Store(&srv)
	stc := &tls.Config{
		MinVersion:     tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return r.srvCert.Load(), nil },
		Time:           func() time.Time { return time.Now().Add(time.Duration(r.skew.Load())) },
	}
	if clientCAs != nil {
		stc.ClientAuth, stc.ClientCAs = tls.RequireAndVerifyClientCert, clientCAs
		stc.VerifyPeerCertificate = func(raw [][]byte, _ [][]*x509.Certificate) error {
			c, err := x509.ParseCertificate(raw[0])
			if err != nil {
				return err
			}
			n, _ := r.seen.LoadOrStore(c.Subject.CommonName, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			if _, ok := r.deny.Load(c.SerialNumber.String()); ok {
				return fmt.Errorf("client certificate %s refused", c.Subject.CommonName)
			}
			return nil
		}
	}
	kc, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "delay", "delay.dlq", "orders"),
		kfake.TLS(stc), kfake.ListenFn(r.brokers.listen))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(kc.Close)
	r.kc = kc
	return r
}

// start runs the bridge with tlsYAML (the kafka.tls line) and opens the
// test's client with testTLS.
func (r *kafkaTLSRig) start(tlsYAML string, testTLS *tls.Config) {
	t := r.t
	cl, err := kgo.NewClient(kgo.SeedBrokers(r.kc.ListenAddrs()...), kgo.DialTLSConfig(testTLS),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ConsumeTopics("orders", "delay.dlq"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cl.Close)
	r.cl = cl
	core, logs := observer.New(zap.DebugLevel)
	r.logs = logs
	yml := kafkaOnlyYAML(t, r.kc.ListenAddrs(), "  group: bridge\n"+tlsYAML+"\n") +
		"targets: {allow: [\"*\"]}\nretry: {initial: 1s, max: 4s, multiplier: 2, jitter: 0.1, max_attempts: 3}\n"
	o := Options{Logger: zap.New(zapcore.NewTee(core)), Clock: r.clk, Kafka: fastKafka}
	r.svc, _, r.done = runYAML(t, yml, o)
	eventually(t, "ready", func() bool { return r.svc.Ready() == nil })
}

func (r *kafkaTLSRig) publish(key, value, after string) {
	r.t.Helper()
	rec := &kgo.Record{Topic: "delay", Partition: 0, Key: []byte(key), Value: []byte(value), Timestamp: r.clk.Now(),
		Headers: []kgo.RecordHeader{{Key: "delay-after", Value: []byte(after)}, {Key: "delay-target", Value: []byte("orders")}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := r.cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
		r.t.Fatalf("produce %s: %v", key, err)
	}
}

// awaitDelivered advances the clock until each of values reached orders
// (or the DLQ), and fails on a value delivered twice.
func (r *kafkaTLSRig) awaitDelivered(values ...string) {
	r.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	missing := func() bool {
		for _, v := range values {
			if r.got["orders/"+v] == 0 {
				return true
			}
		}
		return false
	}
	for missing() {
		r.clk.Advance(time.Second)
		pctx, pcancel := context.WithTimeout(ctx, 300*time.Millisecond)
		fs := r.cl.PollFetches(pctx)
		pcancel()
		if ctx.Err() != nil {
			r.t.Fatalf("deliveries: %v, want %v; readiness %v, stats %+v", r.got, values, r.svc.Ready(), r.svc.Engine().Stats())
		}
		fs.EachRecord(func(rec *kgo.Record) { r.got[rec.Topic+"/"+string(rec.Value)]++ })
	}
	for k, n := range r.got {
		if n != 1 {
			r.t.Errorf("%s delivered %d times", k, n)
		}
	}
}

// watchReady records, until stop is called, the distinct readiness errors
// and how long the bridge was not ready.
func (r *kafkaTLSRig) watchReady() (stop func() (reasons []string, notReady time.Duration)) {
	return watchReady(r.svc)
}

// watchReady records, until stop is called, svc's distinct readiness
// errors and how long it was not ready.
func watchReady(svc *Service) (stop func() (reasons []string, notReady time.Duration)) {
	var (
		mu      sync.Mutex
		reasons []string
		down    time.Duration
	)
	ctx, cancel := context.WithCancel(context.Background())
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		last := time.Now()
		for ctx.Err() == nil {
			time.Sleep(5 * time.Millisecond)
			now := time.Now()
			if err := svc.Ready(); err != nil {
				mu.Lock()
				down += now.Sub(last)
				if len(reasons) == 0 || reasons[len(reasons)-1] != err.Error() {
					reasons = append(reasons, err.Error())
				}
				mu.Unlock()
			}
			last = now
		}
	}()
	return func() ([]string, time.Duration) {
		cancel()
		<-finished
		return reasons, down
	}
}

// warnLines counts the log lines at Warn or above since since.
func (r *kafkaTLSRig) warnLines(since time.Time) (n int, msgs map[string]int) {
	msgs = map[string]int{}
	for _, e := range r.logs.All() {
		if e.Time.After(since) && e.Level >= zap.WarnLevel {
			n++
			msgs[e.Message]++
		}
	}
	return n, msgs
}

// awaitRefused: the bridge's connections are refused since brokenAt.
// It waits for not-ready, publishes "during" (key) and makes it due, then
// waits for readiness naming a TLS failure (and want) and for ten refused
// attempts, so that a retry or log storm would show.
func (r *kafkaTLSRig) awaitRefused(phase, key, want string, brokenAt time.Time) {
	t := r.t
	t.Helper()
	eventually(t, phase+": not ready", func() bool { return r.svc.Ready() != nil })
	t.Logf("%s: not ready %v after the cut: %v", phase, time.Since(brokenAt), r.svc.Ready())
	r.publish(key, "during", "1m")
	r.clk.Advance(2 * time.Minute)
	eventually(t, phase+": readiness naming the TLS failure", func() bool {
		err := r.svc.Ready()
		return err != nil && strings.Contains(err.Error(), want) && strings.Contains(err.Error(), "tls")
	})
	t.Logf("%s: readiness %v after the cut: %v", phase, time.Since(brokenAt), r.svc.Ready())
	acc0 := r.brokers.accepted()
	eventually(t, phase+": ten refused attempts", func() bool { return r.brokers.accepted()-acc0 >= 10 })
	n, msgs := r.warnLines(brokenAt)
	t.Logf("%s: while broken %v: %d warn+ lines %v; %d connections accepted meanwhile",
		phase, time.Since(brokenAt), n, msgs, r.brokers.accepted()-acc0)
}

// checkQuiet fails the test on a log storm while the connections were
// refused (from brokenAt to fixedAt), and logs what was said since.
func (r *kafkaTLSRig) checkQuiet(brokenAt, fixedAt time.Time) {
	r.t.Helper()
	for _, e := range r.logs.All() {
		if e.Time.After(brokenAt) && e.Level >= zap.InfoLevel {
			r.t.Logf("LOG %s %s %s %v", e.Time.Format("15:04:05.000"), e.Level, e.Message, e.ContextMap())
		}
	}
	var n int
	for _, e := range r.logs.All() {
		if e.Time.After(brokenAt) && !e.Time.After(fixedAt) && e.Level >= zap.WarnLevel {
			n++
		}
	}
	if n > 40 {
		r.t.Errorf("%d warn+ lines in %v while refused: a log storm", n, fixedAt.Sub(brokenAt))
	}
}

func (r *kafkaTLSRig) checkRunning() {
	r.t.Helper()
	select {
	case err := <-r.done:
		r.t.Fatalf("bridge exited: %v", err)
	default:
	}
}

// TestKafkaClientCertRotated: the bridge's Kafka client certificate (mutual
// TLS) is replaced in the mounted files while it runs, first in time
// (the broker then refuses the old one), then too late (the certificate
// in the files expired, the broker refuses it at the handshake, and the
// renewed one comes afterwards). Both the source's and the sink's new
// connections must present the files' certificate: a task taken in
// before is delivered, and a message published while refused is taken in
// and delivered once the files are renewed, with no restart.
func TestKafkaClientCertRotated(t *testing.T) {
	serverCA, clientCA := testcert.NewCA(t, "server CA"), testcert.NewCA(t, "client CA")
	r := newKafkaTLSRig(t, serverCA.Issue(t, "broker", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS(), clientCA.Pool)
	dir := t.TempDir()
	caFile, certFile, keyFile := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	testcert.ReplaceFile(t, caFile, serverCA.CertPEM())
	certA := clientCA.Issue(t, "bridge-a", x509.ExtKeyUsageClientAuth)
	testcert.ReplaceFile(t, certFile, certA.CertPEM())
	testcert.ReplaceFile(t, keyFile, certA.KeyPEM(t))
	testCert := clientCA.Issue(t, "test", x509.ExtKeyUsageClientAuth)
	r.start(fmt.Sprintf("  tls: {enabled: true, ca_file: %q, cert_file: %q, key_file: %q}", caFile, certFile, keyFile),
		&tls.Config{RootCAs: serverCA.Pool, Certificates: []tls.Certificate{testCert.TLS()}, MinVersion: tls.VersionTLS12})
	r.publish("a", "before", "1m")
	waitIngested(t, r.svc, 1)

	// 1. Renewed in time: the files get B (valid for an hour), then the
	// broker refuses A and drops every connection.
	certB := issueUntil(t, clientCA, "bridge-b", time.Now().Add(time.Hour))
	testcert.ReplaceFile(t, certFile, certB.CertPEM())
	testcert.ReplaceFile(t, keyFile, certB.KeyPEM(t))
	r.deny.Store(serialOf(t, certA), true)
	stopWatch := r.watchReady()
	t0 := time.Now()
	t.Logf("phase 1: cut %d connections", r.brokers.cut(0))
	r.publish("p1", "in-time", "1m")
	r.clk.Advance(2 * time.Minute)
	r.awaitDelivered("before", "in-time")
	reasons, down := stopWatch()
	t.Logf("phase 1 (renewed before the broker refused the old one): delivered %v in %v; not ready for %v: %q; warn lines %d",
		r.got, time.Since(t0), down, reasons, must(r.warnLines(t0)))
	if n, ok := r.seen.Load("bridge-a"); ok {
		t.Logf("certificate A presented %d times in all", n.(*atomic.Int64).Load())
	}

	// 2. Too late: B expires (the broker's clock passes its NotAfter), the
	// broker drops every connection; C is written only afterwards.
	r.publish("p2", "pending", "1m")
	waitIngested(t, r.svc, 1)
	r.skew.Store(int64(2 * time.Hour))
	stopWatch = r.watchReady()
	brokenAt := time.Now()
	t.Logf("phase 2: cut %d connections", r.brokers.cut(0))
	// The test's own client needs its connections back (its certificate
	// is valid for a day); the bridge's are refused.
	r.awaitRefused("phase 2", "p3", "kafka", brokenAt)

	certC := clientCA.Issue(t, "bridge-c", x509.ExtKeyUsageClientAuth)
	testcert.ReplaceFile(t, certFile, certC.CertPEM())
	testcert.ReplaceFile(t, keyFile, certC.KeyPEM(t))
	fixedAt := time.Now()
	r.awaitDelivered("before", "in-time", "pending", "during")
	t.Logf("phase 2: delivered %v %v after the files were renewed", r.got, time.Since(fixedAt))
	eventually(t, "ready after the renewal", func() bool { return r.svc.Ready() == nil })
	reasons, down = stopWatch()
	t.Logf("phase 2: ready %v after the files were renewed; not ready for %v in all: %q", time.Since(fixedAt), down, reasons)
	r.checkQuiet(brokenAt, fixedAt)
	r.checkRunning()
}

func must(n int, _ map[string]int) int { return n }

func serialOf(t *testing.T, l testcert.Leaf) string {
	t.Helper()
	c, err := x509.ParseCertificate(l.DER)
	if err != nil {
		t.Fatal(err)
	}
	return c.SerialNumber.String()
}

// TestKafkaServerCARotated: the brokers' certificates move to a new CA
// while the bridge runs. Done the safe way (ca_file first holds the old and
// the new CA, the brokers change certificates, then ca_file holds only the
// new CA), the bridge goes on with no restart and at most the blip of the
// dropped connections. Done the wrong way (the brokers move to a CA not
// yet in ca_file), the bridge is not ready naming the TLS failure, and
// recovers by itself once ca_file has the new CA.
func TestKafkaServerCARotated(t *testing.T) {
	ca1, ca2, ca3 := testcert.NewCA(t, "CA 1"), testcert.NewCA(t, "CA 2"), testcert.NewCA(t, "CA 3")
	leaf := func(ca *testcert.CA) tls.Certificate {
		return ca.Issue(t, "broker", x509.ExtKeyUsageServerAuth, "127.0.0.1").TLS()
	}
	r := newKafkaTLSRig(t, leaf(ca1), nil)
	caFile := filepath.Join(t.TempDir(), "ca.crt")
	testcert.ReplaceFile(t, caFile, ca1.CertPEM())
	r.start(fmt.Sprintf("  tls: {enabled: true, ca_file: %q}", caFile),
		&tls.Config{InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}) //nolint:gosec // the test's own client
	r.publish("a", "before", "1m")
	waitIngested(t, r.svc, 1)

	// 1. ca_file: old + new; the broker presents the new CA's certificate.
	testcert.ReplaceFile(t, caFile, append(ca1.CertPEM(), ca2.CertPEM()...))
	stopWatch := r.watchReady()
	t0 := time.Now()
	r.srvCert.Store(new(leaf(ca2)))
	t.Logf("phase 1: cut %d connections", r.brokers.cut(0))
	r.publish("b", "bundle", "1m")
	r.clk.Advance(2 * time.Minute)
	r.awaitDelivered("before", "bundle")
	reasons, down := stopWatch()
	t.Logf("phase 1 (old+new CA in the file, broker on the new one): delivered %v in %v; not ready for %v: %q; warn lines %d",
		r.got, time.Since(t0), down, reasons, must(r.warnLines(t0)))

	// 2. ca_file: the new CA alone.
	testcert.ReplaceFile(t, caFile, ca2.CertPEM())
	stopWatch = r.watchReady()
	t0 = time.Now()
	t.Logf("phase 2: cut %d connections", r.brokers.cut(0))
	r.publish("c", "new-only", "1m")
	r.clk.Advance(2 * time.Minute)
	r.awaitDelivered("before", "bundle", "new-only")
	reasons, down = stopWatch()
	t.Logf("phase 2 (new CA alone in the file): delivered in %v; not ready for %v: %q; warn lines %d",
		time.Since(t0), down, reasons, must(r.warnLines(t0)))

	// 3. The wrong order: the broker moves to CA 3 before the file does.
	r.publish("d", "pending", "1m")
	waitIngested(t, r.svc, 1)
	stopWatch = r.watchReady()
	brokenAt := time.Now()
	r.srvCert.Store(new(leaf(ca3)))
	t.Logf("phase 3: cut %d connections", r.brokers.cut(0))
	r.awaitRefused("phase 3", "e", "kafka target unavailable", brokenAt)
	testcert.ReplaceFile(t, caFile, append(ca2.CertPEM(), ca3.CertPEM()...))
	fixedAt := time.Now()
	r.awaitDelivered("before", "bundle", "new-only", "pending", "during")
	eventually(t, "ready after ca_file caught up", func() bool { return r.svc.Ready() == nil })
	reasons, down = stopWatch()
	t.Logf("phase 3: delivered and ready %v after ca_file caught up; not ready for %v in all: %q", time.Since(fixedAt), down, reasons)
	r.checkQuiet(brokenAt, fixedAt)
	r.checkRunning()
}
