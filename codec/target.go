package codec

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// ErrBadTarget is wrapped by ParseTarget errors.
var ErrBadTarget = errors.New("codec: bad target")

// maxTopicLen is Kafka's limit on topic names.
const maxTopicLen = 249

// MaxSubjectLen bounds a NATS target subject. The server closes the
// connection of a client whose control line (HPUB subject reply sizes) is
// longer than its max_control_line, 4096 bytes by default: a longer subject
// would not fail alone but cut the bridge's connection on every retry.
const MaxSubjectLen = 1024

// ParseTarget resolves a delay-target value. A bare name is a topic or
// subject on own, the source's transport; "kafka:NAME" and "nats:SUBJECT"
// name a transport explicitly, the prefix in any ASCII case ("Kafka:",
// "NATS:", as header names are). The text before the first ':' is always read
// as a prefix, so an unknown prefix ("foo:bar") is an error on both
// transports even though "foo:bar" would be a legal NATS subject: one rule
// for every source is easier to explain than one per transport, and
// "nats:foo:bar" still reaches that subject. The returned name has no prefix
// and is valid for its transport: a Kafka topic of 1..249 characters from
// [a-zA-Z0-9._-], not "." or ".."; a NATS publish subject of at most
// MaxSubjectLen bytes of non-empty '.'-separated tokens without whitespace
// or control characters and without the wildcard tokens "*" and ">", and
// not starting with "//" (the remains of a URL such as "nats://orders").
func ParseTarget(s string, own Transport) (Transport, string, error) {
	t, name, err := parseTarget(s, own)
	if err != nil {
		return 0, "", fmt.Errorf("codec: target %w", err)
	}
	return t, name, nil
}

// CutTransportPrefix splits a "kafka:" or "nats:" prefix, in any ASCII
// case, off s, as ParseTarget reads one: ok is false when s has neither
// (targets.allow patterns use it, so that they read prefixes as targets do).
func CutTransportPrefix(s string) (t Transport, rest string, ok bool) {
	if t, i := transportPrefix(s); t != 0 {
		return t, s[i+1:], true
	}
	return 0, s, false
}

// transportPrefix reads the text before s's first ':' as a transport
// prefix: i is that colon's index (-1: none), t the transport the prefix
// names (0: none, also for an unknown prefix).
func transportPrefix[S ~string | ~[]byte](s S) (t Transport, i int) {
	for i := 0; i < len(s); i++ {
		if s[i] != ':' {
			continue
		}
		switch {
		case foldASCII(s[:i], "kafka"):
			return TransportKafka, i
		case foldASCII(s[:i], "nats"):
			return TransportNATS, i
		}
		return 0, i
	}
	return 0, -1
}

// foldASCII reports whether s is lower, a lower-case ASCII word, in any
// ASCII case ("Kafka", "NATS"). Not strings.EqualFold: that folds the
// Kelvin sign to "k".
func foldASCII[S ~string | ~[]byte](s S, lower string) bool {
	if len(s) != len(lower) {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c != lower[i] && c+('a'-'A') != lower[i] {
			return false
		}
	}
	return true
}

// parseTarget is ParseTarget for header bytes as well as strings, so Parse
// validates a target without first copying it into a string. Its errors
// read as a phrase after the header name and match ErrBadTarget.
func parseTarget[S ~string | ~[]byte](s S, own Transport) (Transport, S, error) {
	var zero S
	t, name := own, s
	if pt, i := transportPrefix(s); pt != 0 {
		t, name = pt, s[i+1:]
	} else if i >= 0 {
		return 0, zero, &targetError{fmt.Sprintf("%s: unknown transport prefix %s (want kafka: or nats:)", short(string(s)), short(string(s[:i])))}
	}
	if len(name) >= 2 && name[0] == '/' && name[1] == '/' {
		// "nats://orders.x" is a URL written where a target goes. Kafka
		// refuses the '/' anyway, but "//orders.x" is a legal NATS subject:
		// taken, the task went to a subject nobody reads, dead-lettered
		// publish-failed only at its due time, or with nats.core_targets
		// published there and lost.
		return 0, zero, &targetError{short(string(s)) + `: a URL, not a target: write kafka:TOPIC or nats:SUBJECT, without "//"`}
	}
	var err error
	switch t {
	case TransportKafka:
		err = checkTopic(name)
	case TransportNATS:
		err = checkSubject(name)
	default:
		err = fmt.Errorf("unknown transport %v", t)
	}
	if err != nil {
		return 0, zero, &targetError{short(string(s)) + ": " + err.Error()}
	}
	return t, name, nil
}

// targetError is a target validation failure; errors.Is matches
// ErrBadTarget.
type targetError struct{ msg string }

func (e *targetError) Error() string { return e.msg }
func (e *targetError) Unwrap() error { return ErrBadTarget }

func checkTopic[S ~string | ~[]byte](name S) error {
	switch {
	case len(name) == 0:
		return errors.New("empty topic name (Kafka)")
	case len(name) > maxTopicLen:
		return fmt.Errorf("topic name longer than %d characters (Kafka)", maxTopicLen)
	case string(name) == "." || string(name) == "..":
		return errors.New(`topic name cannot be "." or ".." (Kafka)`)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("illegal character %q in a Kafka topic (allowed: a-z A-Z 0-9 . _ -)", c)
		}
	}
	return nil
}

func checkSubject[S ~string | ~[]byte](name S) error {
	if len(name) == 0 {
		return errors.New("empty NATS subject")
	}
	if len(name) > MaxSubjectLen {
		return fmt.Errorf("NATS subject longer than %d bytes", MaxSubjectLen)
	}
	start, high := 0, false
	for i := 0; i <= len(name); i++ {
		if i < len(name) && name[i] != '.' {
			if c := name[i]; c <= ' ' || c == 0x7f {
				return fmt.Errorf("NATS subject has whitespace or control character %q", c)
			} else if c >= utf8.RuneSelf {
				high = true
			}
			continue
		}
		switch tok := name[start:i]; {
		case len(tok) == 0:
			return errors.New("NATS subject has an empty token")
		case len(tok) == 1 && (tok[0] == '*' || tok[0] == '>'):
			return fmt.Errorf("NATS subject has wildcard %q; a publish subject must be literal", tok[0])
		}
		start = i + 1
	}
	// Checked only when a non-ASCII byte was seen, so the usual ASCII
	// subject costs nothing (and the []byte form allocates nothing).
	if high && !utf8.ValidString(string(name)) {
		return errors.New("NATS subject is not valid UTF-8")
	}
	return nil
}

// natsNameByte reports whether NATS carries byte c in a header name as it
// is: printable ASCII except space and "()/,:;<=>?@[\]{}.
func natsNameByte(c byte) bool {
	return c > ' ' && c < 0x7f && strings.IndexByte(`"()/,:;<=>?@[\]{}`, c) < 0
}

// NATSHeaderName is a header name as a NATS header name, for a message
// from transport from; nats.go refuses the whole message for one name NATS
// cannot carry. A valid name is kept as it is, except, from Kafka, one with
// a '%' in it; in any other, each byte NATS cannot carry, and '%', is
// written %XX (RFC 3986 percent-encoding: decode it as a URL path, not as
// a form, where '+' is a space). So distinct Kafka names stay distinct ("a
// b" is "a%20b", and "a%20b" is "a%2520b"), and a NATS source's names,
// valid NATS names already, arrive as they are (CONTRACT §2).
func NATSHeaderName(k string, from Transport) string {
	g := natsNameGrowth(k, from)
	if g == 0 {
		return k
	}
	return string(appendPercent(make([]byte, 0, len(k)+g), k, func(c byte) bool { return !natsNameByte(c) || c == '%' }))
}

// appendPercent appends s to dst with each byte enc reports written %XX.
func appendPercent[T string | []byte](dst []byte, s T, enc func(byte) bool) []byte {
	const hex = "0123456789ABCDEF"
	for i := 0; i < len(s); i++ {
		if c := s[i]; enc(c) {
			dst = append(dst, '%', hex[c>>4], hex[c&15])
		} else {
			dst = append(dst, c)
		}
	}
	return dst
}

// natsNameGrowth is how much longer NATSHeaderName(k, from) is than k: 2
// bytes for each byte it encodes, none for a name it keeps as it is.
func natsNameGrowth(k string, from Transport) int {
	bad, pct := 0, 0
	for i := 0; i < len(k); i++ {
		switch c := k[i]; {
		case c == '%':
			pct++
		case !natsNameByte(c):
			bad++
		}
	}
	if bad == 0 && (pct == 0 || from == TransportNATS) {
		return 0
	}
	return 2 * (bad + pct)
}
