package config

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/delaybridge/delaybridge/codec"
)

// AllowTarget reports whether targets.allow lets a publisher name the target
// name on transport t. An empty allow list denies everything.
//
// Pattern syntax. A pattern may start with "kafka:" or "nats:" (in any
// ASCII case, as a delay-target's prefix) to apply to that transport only;
// without a prefix it applies to both. The rest is matched against the
// name token by token, tokens being separated by dots
// (NATS subjects, and the usual Kafka naming "orders.eu.created"):
//
//   - "*" or ">" as the whole name pattern matches any name ("*" alone
//     matches any target of any transport, "kafka:*" any Kafka topic);
//   - otherwise "*" matches any run of characters within one token, never a
//     dot: "orders.*" matches "orders.created", not "orders.eu.created";
//   - "?" matches one character other than a dot;
//   - "[abc]", "[a-z]", "[^a-z]" (or "[!a-z]") match one character of a
//     class, never a dot;
//   - "\x" matches x literally;
//   - ">" as the last token matches one or more tokens, as in NATS:
//     "events.>" matches "events.a" and "events.a.b", not "events".
//
// NATS subjects of the server's own APIs and replies ("$JS.API.…",
// "$SYS.…", "$KV.…", any "$…", and "_INBOX.…") are matched only by a
// pattern that names them literally ("$KV.>", "nats:_INBOX.x"), never by
// "*", ">" or a leading wildcard token: the bridge publishes with its own
// credentials, which may include $JS.API subjects of the delay stream. The
// same holds for Kafka topics that start with "_" ("_schemas",
// "_confluent-…", "__consumer_offsets"): "kafka:_schemas" matches one.
func (c *Config) AllowTarget(t codec.Transport, name string) bool {
	for _, p := range c.Targets.Allow {
		if matchTarget(p, t, name) {
			return true
		}
	}
	return false
}

// HasTransport reports whether transport t is configured (its block is
// present).
func (c *Config) HasTransport(t codec.Transport) bool {
	return (t == codec.TransportKafka && c.Kafka != nil) || (t == codec.TransportNATS && c.NATS != nil)
}

// DelaySource reports whether the target name on transport t is one of
// the bridge's delay sources: a configured Kafka delay topic, or a NATS
// subject a source subject matches. The codec refuses such a target
// (target-not-allowed, whatever targets.allow says): delivered there
// without its control headers, the message would come back as a
// missing-due dead letter.
func (c *Config) DelaySource(t codec.Transport, name string) bool {
	switch {
	case t == codec.TransportKafka && c.Kafka != nil:
		for _, src := range c.Kafka.Sources {
			if src.Topic == name {
				return true
			}
		}
	case t == codec.TransportNATS && c.NATS != nil:
		for _, src := range c.NATS.Sources {
			if SubjectMatches(src.Subject, name) {
				return true
			}
		}
	}
	return false
}

func matchTarget(pattern string, t codec.Transport, name string) bool {
	if pattern == "*" {
		return name != "" && !systemSubject(t, name)
	}
	if pt, rest, ok := codec.CutTransportPrefix(pattern); ok {
		if t != pt {
			return false
		}
		pattern = rest
	}
	if systemSubject(t, name) && !namesSystemSubject(t, pattern) {
		return false
	}
	return matchName(pattern, name)
}

// systemSubject reports whether name is a NATS subject of the server's own
// APIs ("$…") or replies ("_INBOX.…"), or a Kafka topic whose name starts
// with "_": by convention internal to the cluster or its tools
// ("__consumer_offsets", "_schemas", "_confluent-…"). Only a pattern that
// names such a target literally matches it, never "*", ">" or a leading
// wildcard.
func systemSubject(t codec.Transport, name string) bool {
	switch t {
	case codec.TransportNATS:
		return strings.HasPrefix(name, "$") || strings.HasPrefix(name, "_INBOX.")
	case codec.TransportKafka:
		return strings.HasPrefix(name, "_")
	}
	return false
}

// namesSystemSubject reports whether a name pattern starts with the literal
// prefix of a system name of transport t (systemSubject), the only kind of
// pattern that may match one.
func namesSystemSubject(t codec.Transport, pattern string) bool {
	if t == codec.TransportKafka {
		return strings.HasPrefix(pattern, "_")
	}
	return strings.HasPrefix(pattern, "$") || strings.HasPrefix(pattern, "_INBOX.")
}

// matchName matches a name pattern (no transport prefix) against name.
func matchName(pattern, name string) bool {
	if name == "" || pattern == "" {
		return false
	}
	if pattern == "*" || pattern == ">" {
		return true
	}
	for {
		ptok, prest, pmore := strings.Cut(pattern, ".")
		if ptok == ">" && !pmore {
			return true // name is non-empty: at least one token is left
		}
		ntok, nrest, nmore := strings.Cut(name, ".")
		if !matchToken(ptok, ntok) {
			return false
		}
		if pmore != nmore {
			return false
		}
		if !pmore {
			return true
		}
		pattern, name = prest, nrest
		if name == "" {
			return false // "a." : a trailing empty token
		}
	}
}

// matchToken matches one dot-free token. The single remembered star makes it
// linear in practice and never exponential: on a mismatch only the last star
// absorbs one more character (which is enough because stars cannot span a
// dot, and tokens hold none).
func matchToken(p, s string) bool {
	star, starS := -1, 0
	pi, si := 0, 0
	for si < len(s) {
		if pi < len(p) {
			switch p[pi] {
			case '*':
				star, starS = pi, si
				pi++
				continue
			case '?':
				_, w := utf8.DecodeRuneInString(s[si:])
				pi++
				si += w
				continue
			case '[':
				r, w := utf8.DecodeRuneInString(s[si:])
				if ok, end := matchClass(p[pi:], r); ok {
					pi += end
					si += w
					continue
				}
			case '\\':
				if pi+1 < len(p) && p[pi+1] == s[si] {
					pi += 2
					si++
					continue
				}
			default:
				if p[pi] == s[si] {
					pi++
					si++
					continue
				}
			}
		}
		if star < 0 {
			return false
		}
		_, w := utf8.DecodeRuneInString(s[starS:])
		starS += w
		pi, si = star+1, starS
	}
	for pi < len(p) && p[pi] == '*' {
		pi++
	}
	return pi == len(p)
}

// matchClass matches r against the class that starts p ("[...]"); end is the
// length of the class text. A malformed class never matches (Validate
// refuses it up front).
func matchClass(p string, r rune) (ok bool, end int) {
	i := 1
	negate := false
	if i < len(p) && (p[i] == '^' || p[i] == '!') {
		negate = true
		i++
	}
	matched := false
	first := true
	for {
		if i >= len(p) {
			return false, 0
		}
		if p[i] == ']' && !first {
			i++
			break
		}
		first = false
		lo, w := classChar(p[i:])
		if w == 0 {
			return false, 0
		}
		i += w
		hi := lo
		if i+1 < len(p) && p[i] == '-' && p[i+1] != ']' {
			hi, w = classChar(p[i+1:])
			if w == 0 {
				return false, 0
			}
			i += 1 + w
		}
		if lo <= r && r <= hi {
			matched = true
		}
	}
	return matched != negate, i
}

func classChar(p string) (rune, int) {
	if p[0] == '\\' {
		if len(p) < 2 {
			return 0, 0
		}
		r, w := utf8.DecodeRuneInString(p[1:])
		return r, 1 + w
	}
	r, w := utf8.DecodeRuneInString(p)
	return r, w
}

var errBadPattern = errors.New("bad pattern")

func errKafkaComma(p string) error {
	return fmt.Errorf(`%w %q: a Kafka topic cannot contain "," (only a-z A-Z 0-9 . _ -), so it would match no target; to list two patterns give two items (in DELAYBRIDGE_TARGETS_ALLOW: a comma without a backslash before it)`, errBadPattern, p)
}

// checkPattern validates a targets.allow pattern.
func checkPattern(p string) error {
	if p == "*" {
		return nil
	}
	name := p
	kafka := false
	if pt, rest, ok := codec.CutTransportPrefix(p); ok {
		name, kafka = rest, pt == codec.TransportKafka
	}
	if name == "" {
		return fmt.Errorf("%w %q: empty name pattern", errBadPattern, p)
	}
	if !utf8.ValidString(name) {
		return fmt.Errorf("%w %q: not valid UTF-8", errBadPattern, p)
	}
	// A target starting with "//" is refused at ingest (a URL written as a
	// target, bad-target), so such a pattern could never match: every
	// message would be dead-lettered target-not-allowed.
	if strings.HasPrefix(name, "//") {
		return fmt.Errorf("%w %q: a URL, not a pattern: write kafka:NAME or nats:SUBJECT, without \"//\"", errBadPattern, p)
	}
	if strings.ContainsAny(name, " \t\r\n") {
		return fmt.Errorf("%w %q: contains white space", errBadPattern, p)
	}
	if name == "*" || name == ">" {
		return nil
	}
	toks := strings.Split(name, ".")
	for i, tok := range toks {
		if tok == "" {
			return fmt.Errorf("%w %q: empty token between dots", errBadPattern, p)
		}
		if strings.Contains(tok, ">") && (tok != ">" || i != len(toks)-1) {
			return fmt.Errorf("%w %q: \">\" must be the whole last token", errBadPattern, p)
		}
		for j := 0; j < len(tok); j++ {
			switch tok[j] {
			case '\\':
				if j+1 >= len(tok) {
					return fmt.Errorf("%w %q: trailing backslash", errBadPattern, p)
				}
				j++
				if kafka && tok[j] == ',' {
					return errKafkaComma(p)
				}
			case ',':
				// A NATS subject may hold a comma (written \, in
				// DELAYBRIDGE_TARGETS_ALLOW); a Kafka topic never does, so
				// such a pattern would match nothing.
				if kafka {
					return errKafkaComma(p)
				}
			case '[':
				if _, end := matchClass(tok[j:], 0); end == 0 {
					return fmt.Errorf("%w %q: unterminated or malformed [class]", errBadPattern, p)
				}
				_, end := matchClass(tok[j:], 0)
				j += end - 1
			case ']':
				return fmt.Errorf("%w %q: \"]\" without \"[\"", errBadPattern, p)
			}
		}
	}
	return nil
}
