package nats

import (
	"slices"
	"strings"

	natsgo "github.com/nats-io/nats.go"

	"github.com/delaybridge/delaybridge/codec"
)

// validFilter reports whether f is a NATS subject filter: non-empty dot
// separated tokens without spaces, '*' only as a whole token and '>' only as
// the whole last token.
func validFilter(f string) bool {
	if f == "" || strings.ContainsAny(f, " \t\r\n") {
		return false
	}
	toks := strings.Split(f, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return false
		case t == ">":
			if i != len(toks)-1 {
				return false
			}
		case strings.ContainsAny(t, "*>") && t != "*":
			return false
		}
	}
	return true
}

// subjectMatch reports whether the literal subject matches filter: '*'
// matches exactly one token, '>' one or more trailing tokens.
func subjectMatch(filter, subject string) bool {
	for {
		ft, frest, fmore := strings.Cut(filter, ".")
		st, srest, smore := strings.Cut(subject, ".")
		if st == "" {
			return false
		}
		switch ft {
		case ">":
			return !fmore
		case "*":
		default:
			if ft != st {
				return false
			}
		}
		if !fmore || !smore {
			return fmore == smore
		}
		filter, subject = frest, srest
	}
}

// rulesFor returns the rules of the first source whose filter matches subject.
func rulesFor(sources []SourceConfig, subject string) (*codec.Rules, bool) {
	for i := range sources {
		if subjectMatch(sources[i].Subject, subject) {
			return sources[i].Rules, true
		}
	}
	return nil, false
}

// headersIn converts NATS headers to codec headers. A key with several
// values becomes repeated entries in value order. NATS keeps headers in a
// map, so the order of distinct keys on the wire is not known; keys are
// sorted to make the result deterministic.
func headersIn(h natsgo.Header) []codec.Header {
	if len(h) == 0 {
		return nil
	}
	keys := make([]string, 0, len(h))
	n := 0
	for k, vs := range h {
		keys = append(keys, k)
		n += len(vs)
	}
	slices.Sort(keys)
	out := make([]codec.Header, 0, n)
	for _, k := range keys {
		for _, v := range h[k] {
			out = append(out, codec.Header{Key: k, Value: []byte(v)})
		}
	}
	return out
}

// publishDirective reports whether a header instructs JetStream about the
// publish itself (optimistic concurrency, rollups, TTLs, schedules, atomic
// batches, counters, trace-only). Such headers addressed the publish to the delay
// stream; forwarded to the target they would make the delivery fail or
// change its meaning, so the Sink drops them. Nats-Msg-Id is replaced by
// the delivery id.
func publishDirective(key string) bool {
	if len(key) < 5 || !strings.EqualFold(key[:5], "nats-") {
		return false
	}
	k := strings.ToLower(key[5:])
	switch {
	case k == "msg-id", strings.HasPrefix(k, "expected-"), k == "rollup", k == "ttl",
		strings.HasPrefix(k, "schedule"), strings.HasPrefix(k, "batch-"), k == "incr",
		k == "required-api-level",
		// Nats-Stream-Source: JetStream adds it to every message a stream
		// sources from another (a hub stream gathering leaf or edge
		// streams), and every stream refuses a publish that carries it
		// (10227, "message stream source header is not allowed"): a delay
		// stream that sources would deliver nothing and dead-letter
		// nothing. The server drops it too when it sources a chain.
		k == "stream-source",
		// Nats-Stream, Nats-Subject, Nats-Sequence, Nats-Time-Stamp,
		// Nats-Last-Sequence (and Nats-Msg-Size, Nats-Num-Pending,
		// Nats-UpTo-Sequence): what a RePublish or a direct get adds to
		// say where a message is stored. A delay message that came through
		// a republish (or was copied from a direct get) carries another
		// stream's; forwarded, they come first on the target, before the
		// copies the target's own direct get and RePublish append, and
		// readers take the first: a KV Get reports another stream's
		// sequence as the revision, and an Update with it fails.
		k == "stream", k == "subject", k == "sequence", k == "time-stamp",
		k == "last-sequence", k == "msg-size", k == "num-pending", k == "upto-sequence",
		// Nats-Trace-Only (with a Nats-Trace-Dest) makes the server trace
		// the publish instead of delivering it: no stream stores it and no
		// PubAck comes, so the delivery would wait as an outage forever.
		// Nats-Trace-Dest alone makes the server publish a trace event
		// (with every header of the message) on that subject with the
		// bridge's permissions: a subject targets.allow never checked.
		// A stream stores it disabled, but a Kafka record carries it as
		// the publisher wrote it. All Nats-Trace-* headers are dropped.
		strings.HasPrefix(k, "trace-"):
		return true
	}
	return false
}

// headersOut converts task headers to a NATS header, keeping repeated keys
// and their order, dropping JetStream publish directives and setting
// Nats-Msg-Id to msgID; from is the transport the task came from.
func headersOut(hs []codec.Header, msgID string, from codec.Transport) natsgo.Header {
	h := make(natsgo.Header, len(hs)+1)
	for _, x := range hs {
		if publishDirective(x.Key) {
			continue
		}
		k := codec.NATSHeaderName(x.Key, from)
		if k == "" {
			continue // NATS has no empty header name
		}
		h[k] = append(h[k], string(x.Value))
	}
	h[codec.HeaderNatsMsgID] = []string{msgID}
	return h
}

// filterCovers reports whether every subject matched by filter sub is also
// matched by filter super.
func filterCovers(super, sub string) bool {
	for {
		pt, prest, pmore := strings.Cut(super, ".")
		bt, brest, bmore := strings.Cut(sub, ".")
		switch {
		case bt == "":
			return false
		case pt == ">":
			return true
		case bt == ">":
			return false
		case pt == "*":
		case pt != bt:
			return false
		}
		if !pmore || !bmore {
			return pmore == bmore
		}
		super, sub = prest, brest
	}
}

// coveringFilters drops the filters another one in the list already
// covers (and duplicates), keeping order: JetStream refuses overlapping
// subjects in a stream and overlapping filters in a consumer.
func coveringFilters(filters []string) []string {
	out := make([]string, 0, len(filters))
	for i, f := range filters {
		covered := false
		for j, g := range filters {
			if i == j {
				continue
			}
			// Of two equal filters keep the first.
			if filterCovers(g, f) && (!filterCovers(f, g) || j < i) {
				covered = true
				break
			}
		}
		if !covered {
			out = append(out, f)
		}
	}
	return out
}

// filtersOverlap reports whether some subject matches both filters a and b.
func filtersOverlap(a, b string) bool {
	for {
		at, arest, amore := strings.Cut(a, ".")
		bt, brest, bmore := strings.Cut(b, ".")
		switch {
		case at == ">" || bt == ">":
			return at != "" && bt != ""
		case at != bt && at != "*" && bt != "*":
			return false
		}
		if !amore || !bmore {
			return amore == bmore
		}
		a, b = arest, brest
	}
}
