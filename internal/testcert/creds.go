package testcert

import (
	"testing"

	"github.com/nats-io/jwt/v2"
	"github.com/nats-io/nkeys"
)

// NATSCreds makes a NATS .creds file's contents, as nsc writes them: a
// user JWT (signed by a throwaway account) and the user's nkey seed, which
// it returns too.
func NATSCreds(t testing.TB) (creds, seed []byte) {
	t.Helper()
	acc, err := nkeys.CreateAccount()
	if err != nil {
		t.Fatal(err)
	}
	user, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	upub, err := user.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	seed, err = user.Seed()
	if err != nil {
		t.Fatal(err)
	}
	token, err := jwt.NewUserClaims(upub).Encode(acc)
	if err != nil {
		t.Fatal(err)
	}
	creds, err = jwt.FormatUserConfig(token, seed)
	if err != nil {
		t.Fatal(err)
	}
	return creds, seed
}
