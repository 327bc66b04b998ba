package service

import (
	"errors"
	"strconv"
	"testing"

	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/delaybridge/delaybridge/bridge/kafka"
)

// TestWrongPasswordFailsFastWithUnresolvableSecondBroker: refused
// credentials end the start at once (README: "Refused credentials, a
// failed TLS handshake or an invalid config end the process at once"),
// also when another configured broker's name does not resolve. check
// joins every broker's dial error, so the ErrAuth of the first broker and
// the *net.DNSError of the second are one error; unreachable() matches the
// DNS error anywhere in it and retried the refused login forever.
func TestWrongPasswordFailsFastWithUnresolvableSecondBroker(t *testing.T) {
	kc, err := kfake.NewCluster(kfake.EnableSASL(), kfake.Superuser("PLAIN", "bridge", "right"), kfake.SeedTopics(1, kafkaDelay, kafkaDLQ))
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	yml := `
data_dir: ` + strconv.Quote(t.TempDir()) + `
kafka:
  brokers: [` + strconv.Quote(kc.ListenAddrs()[0]) + `, "nosuchhost.invalid:9092"]
  sasl: {mechanism: PLAIN, username: bridge, password: wrong}
  sources: [{topic: delay, dlq: delay.dlq}]
admin: {listen: "127.0.0.1:0"}
`
	timedOut, err := runToStartError(t, yml)
	if timedOut {
		t.Fatalf("Run retried a refused login until the deadline (Run = %v)", err)
	}
	if !errors.Is(err, kafka.ErrAuth) {
		t.Fatalf("Run = %v, want an error wrapping kafka.ErrAuth", err)
	}
}
