package config

import (
	"strings"
	"testing"
)

// TestNATSURLListsAsBefore (review R212): urlSegments (f54080f) must not
// change which nats.url lists load. Each row's verdict is the one before
// f54080f (each comma-separated piece parsed on its own): lists of servers
// with and without credentials, IPv6 hosts, tokens, spaces load; pieces
// without a scheme were and are refused.
func TestNATSURLListsAsBefore(t *testing.T) {
	for _, tc := range []struct {
		url string
		ok  bool
	}{
		{"nats://a:4222", true},
		{"nats://a:4222,nats://b:4222,nats://c:4222", true},
		{"nats://a:4222, nats://b:4222", true},
		{"nats://u:p@a:4222,nats://u:p@b:4222", true},
		{"nats://a:4222,nats://u:p@b:4222", true},
		{"nats://u:p@a:4222,nats://b:4222", true},
		{"nats://tok@a:4222,tls://tok@b:4222", true},
		{"nats://[::1]:4222,nats://[fe80::1%25eth0]:4222", true},
		{"nats://u:p@[::1]:4222,nats://[::2]:4222", true},
		{"tls://a:4222,wss://b:443/ws", true},
		{"nats://u:p%2Cw@a:4222,nats://b:4222", true},
		// No scheme: refused before (url.Parse takes "b" or "u" for one) and now.
		{"nats://a:4222,b:4222", false},
		{"nats://a:4222,u:p@b:4222", false},
		{"nats://a:4222,tok@b:4222", false},
		{"a:4222", false},
		{"nats://a:4222,", false},
	} {
		c := mustLoad(t, validYAML)
		c.NATS.URL = tc.url
		if err := c.Validate(); (err == nil) != tc.ok {
			t.Errorf("nats.url %q: error %v, want ok %v as before", tc.url, err, tc.ok)
		}
	}
}

// TestNATSURLCommaTokenNoSchemeRedacted (review R212): a token with a
// comma in a URL without a scheme, "s3cr,3t@host:4222" (the NATS client
// adds nats://), is refused; urlSegments joined pieces only after one with
// a scheme, so the piece before the comma, "s3cr", was shown as it is in
// the error ("... is not a URL like nats://host:4222"), on stderr and in
// the start log.
func TestNATSURLCommaTokenNoSchemeRedacted(t *testing.T) {
	for _, u := range []string{"s3cr,3t@a:4222", "nats://a:4222,s3cr,3t@b:4222", "u:s3cr,3t@b:4222,nats://a:4222"} {
		c := mustLoad(t, validYAML)
		c.NATS.URL = u
		err := c.Validate()
		if err == nil {
			t.Fatalf("nats.url %q loaded", u)
		}
		if strings.Contains(err.Error(), "s3cr") || strings.Contains(RedactURLs(u), "s3cr") {
			t.Errorf("nats.url %q: error %q / RedactURLs %q show the credential up to its comma", u, err, RedactURLs(u))
		}
	}
}
