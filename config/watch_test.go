package config

import (
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/internal/testcert"
)

// swap replaces path's content as a Kubernetes Secret update does (a new
// file renamed over it); inPlace rewrites the same file instead, as an
// editor or "echo >" does.
func swap(t *testing.T, path, data string, inPlace bool) {
	t.Helper()
	if inPlace {
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return
	}
	testcert.ReplaceFile(t, path, []byte(data))
}

func TestSecretFunc(t *testing.T) {
	type step struct {
		write   *string // nil: leave the file; "" with remove: delete it
		remove  bool
		inPlace bool
		want    string
		warns   int // warnings logged so far
		infos   int // "file read again" so far
	}
	s := func(v string) *string { return &v }
	for _, tc := range []struct {
		name, key string
		steps     []step
	}{
		{"rotated by rename", "nats.password", []step{
			{want: "first"},
			{write: s("second\n"), want: "second", infos: 1},
			{want: "second", infos: 1}, // unchanged: not logged
			{write: s("third\r\n"), want: "third", infos: 2},
		}},
		{"rewritten in place", "kafka.sasl.password", []step{
			{write: s("longer-secret\n"), inPlace: true, want: "longer-secret"},
		}},
		{"removed, then back", "admin.token", []step{
			{remove: true, want: "first", warns: 1},
			{remove: true, want: "first", warns: 1}, // the same error: logged once
			{write: s("back\n"), want: "back", warns: 1, infos: 1},
		}},
		{"emptied", "nats.token", []step{
			{write: s("\n"), want: "first", warns: 1},
			{write: s("filled\n"), want: "filled", warns: 1, infos: 1},
		}},
		{"bearer token no header can carry", "admin.token", []step{
			{write: s(" spaced \n"), want: "first", warns: 1},
			{write: s("tab\there\n"), want: "first", warns: 1}, // same error text
		}},
		{"a password may hold spaces", "nats.password", []step{
			{write: s(" spaced \n"), want: " spaced "},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			core, logs := observer.New(zap.InfoLevel)
			file := filepath.Join(t.TempDir(), "secret")
			swap(t, file, "first\n", true)
			get := SecretFunc(tc.key+"_file", file, "first", zap.New(core))
			for i, st := range tc.steps {
				switch {
				case st.remove:
					if err := os.Remove(file); err != nil && !os.IsNotExist(err) {
						t.Fatal(err)
					}
				case st.write != nil:
					swap(t, file, *st.write, st.inPlace)
				}
				if got := get(); got != st.want {
					t.Fatalf("step %d: %q, want %q", i, got, st.want)
				}
				warns := logs.FilterLevelExact(zap.WarnLevel).Len()
				infos := logs.FilterMessage("file read again").Len()
				if warns != st.warns || infos != st.infos {
					t.Fatalf("step %d: %d warnings, %d reads logged; want %d, %d: %v", i, warns, infos, st.warns, st.infos, logs.All())
				}
			}
		})
	}

	t.Run("no file", func(t *testing.T) {
		if got := SecretFunc("nats.token_file", "", "inline", nil)(); got != "inline" {
			t.Fatalf("%q, want the inline value", got)
		}
	})
}

// TestClientTLSRotation: Config gives each connection the CA file as it
// is then; a CA file that breaks keeps the last pool that read; no CA
// file, or verification off, has no pool to watch.
func TestClientTLSRotation(t *testing.T) {
	dir := t.TempDir()
	a, b := testcert.NewCA(t, "CA a"), testcert.NewCA(t, "CA b")
	caFile := filepath.Join(dir, "ca.pem")
	swap(t, caFile, string(a.CertPEM()), true)
	ct, err := TLS{Enabled: true, CAFile: caFile, ServerName: "x.test"}.Client(nil)
	if err != nil {
		t.Fatal(err)
	}
	trusts := func(ca *testcert.CA) bool {
		cfg := ct.Config()
		return cfg.ServerName == "x.test" && cfg.RootCAs != nil && cfg.RootCAs.Equal(ca.Pool)
	}
	if !trusts(a) {
		t.Fatal("the first pool is not CA a's")
	}
	swap(t, caFile, string(b.CertPEM()), false)
	if !trusts(b) {
		t.Fatal("after the rotation the pool is not CA b's")
	}
	pool, err := ct.RootCAsFunc()()
	if err != nil || !pool.Equal(b.Pool) {
		t.Fatalf("RootCAsFunc after the rotation: %v, %v", pool, err)
	}
	swap(t, caFile, "not pem", false)
	if !trusts(b) {
		t.Fatal("a CA file without PEM replaced the pool")
	}
	c1, c2 := ct.Config(), ct.Config()
	c1.ServerName = "changed"
	if c2.ServerName != "x.test" {
		t.Fatal("Config returned a shared configuration")
	}

	for _, tc := range []struct {
		name string
		tls  TLS
	}{
		{"system roots", TLS{Enabled: true}},
		{"verification off", TLS{Enabled: true, CAFile: filepath.Join(dir, "ca.pem.orig"), InsecureSkipVerify: true}},
	} {
		if tc.tls.CAFile != "" {
			swap(t, tc.tls.CAFile, string(a.CertPEM()), true)
		}
		ct, err := tc.tls.Client(nil)
		if err != nil {
			t.Fatal(err)
		}
		if ct.RootCAsFunc() != nil {
			t.Errorf("%s: a CA pool is watched", tc.name)
		}
	}
}
