package codec

import (
	"errors"
	"fmt"
	"strings"
)

// ErrBadTarget is wrapped by ParseTarget errors.
var ErrBadTarget = errors.New("codec: bad target")

// maxTopicLen is Kafka's limit on topic names.
const maxTopicLen = 249

// ParseTarget resolves a delay-target value. A bare name is a topic or
// subject on own, the source's transport; "kafka:NAME" and "nats:SUBJECT"
// name a transport explicitly. The text before the first ':' is always read
// as a prefix, so an unknown prefix ("foo:bar") is an error on both
// transports even though "foo:bar" would be a legal NATS subject: one rule
// for every source is easier to explain than one per transport, and
// "nats:foo:bar" still reaches that subject. The returned name has no prefix
// and is valid for its transport: a Kafka topic of 1..249 characters from
// [a-zA-Z0-9._-], not "." or ".."; a NATS publish subject of non-empty
// '.'-separated tokens without whitespace or control characters and without
// the wildcard tokens "*" and ">".
func ParseTarget(s string, own Transport) (Transport, string, error) {
	t, name := own, s
	if i := strings.IndexByte(s, ':'); i >= 0 {
		switch prefix := s[:i]; prefix {
		case "kafka":
			t = TransportKafka
		case "nats":
			t = TransportNATS
		default:
			return 0, "", fmt.Errorf("%w: %s: unknown transport prefix %s (want kafka: or nats:)", ErrBadTarget, short(s), short(prefix))
		}
		name = s[i+1:]
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
		return 0, "", fmt.Errorf("%w: %s: %v", ErrBadTarget, short(s), err)
	}
	return t, name, nil
}

func checkTopic(name string) error {
	switch {
	case name == "":
		return errors.New("empty Kafka topic")
	case len(name) > maxTopicLen:
		return fmt.Errorf("Kafka topic longer than %d characters", maxTopicLen)
	case name == "." || name == "..":
		return errors.New(`Kafka topic cannot be "." or ".."`)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("Kafka topic has illegal character %q (allowed: a-z A-Z 0-9 . _ -)", c)
		}
	}
	return nil
}

func checkSubject(name string) error {
	if name == "" {
		return errors.New("empty NATS subject")
	}
	start := 0
	for i := 0; i <= len(name); i++ {
		if i < len(name) && name[i] != '.' {
			if c := name[i]; c <= ' ' || c == 0x7f {
				return fmt.Errorf("NATS subject has whitespace or control character %q", c)
			}
			continue
		}
		switch tok := name[start:i]; tok {
		case "":
			return errors.New("NATS subject has an empty token")
		case "*", ">":
			return fmt.Errorf("NATS subject has wildcard %q; a publish subject must be literal", tok)
		}
		start = i + 1
	}
	return nil
}
