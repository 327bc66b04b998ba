package service

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestPublisherMistakeDetails: the dead letter of a common publisher
// mistake says what to do, on both transports: a delay-at in Unix
// seconds is refused (it fired at once, as a time in January 1970) and
// says so; one in microseconds or nanoseconds names the unit (it said only that the
// number of milliseconds lay outside 1970..9999), and a missing-due names
// the header that looks like a control header but is not one (it said
// only that neither delay-at nor delay-after was set, or that a cancel
// had no delay-id).
func TestPublisherMistakeDetails(t *testing.T) {
	e := newEnv(t, "")
	e.start()
	due := e.clk.Now().Add(30 * time.Minute)
	cases := []struct {
		name, header, value, code, detail string
	}{
		{"seconds", "delay-at", strconv.FormatInt(due.Unix(), 10), "bad-due", "has 10 digits: Unix seconds (" + due.UTC().Format(time.RFC3339) + "), not milliseconds; multiply by 1000"},
		{"micros", "delay-at", strconv.FormatInt(due.UnixMicro(), 10), "bad-due", "its 16 digits look like Unix microseconds: divide by 1000"},
		{"nanos", "delay-at", strconv.FormatInt(due.UnixNano(), 10), "bad-due", "its 19 digits look like Unix nanoseconds: divide by 1000000"},
		{"underscore", "Delay_At", strconv.FormatInt(due.UnixMilli(), 10), "missing-due", `header "Delay_At" is not read: the name is delay-at`},
		{"x-prefix", "X-Delay-After", "30m", "missing-due", `header "X-Delay-After" is not read: the name is delay-after`},
	}
	for _, c := range cases {
		e.publishKafka(0, time.Time{}, []byte(c.name), []byte("kafka "+c.name), c.header, c.value, "delay-target", "orders")
		e.publishNATS("delay.m", []byte("nats "+c.name), c.header, c.value, "delay-target", "orders.m")
	}
	// A cancel whose delay-id header is misspelled, without a key or a
	// Nats-Msg-Id to fall back on, names no task.
	e.publishKafka(0, time.Time{}, nil, []byte("kafka cancel"), "delay-cancel", "true", "delay_id", "order-7")
	e.publishNATS("delay.m", []byte("nats cancel"), "delay-cancel", "true", "delay_id", "order-7")
	got := e.waitFor("the dead letters", func(ds []delivery) bool {
		return countDest(ds, func(d delivery) bool { return d.dest == kafkaDLQ || d.dest == "dlq.delay" }) >= 2*len(cases)+2
	})
	vals := byValue(got, "")
	cases = append(cases, struct{ name, header, value, code, detail string }{
		name: "cancel", code: "missing-due", detail: `names no task to cancel; header "delay_id" is not read: the name is delay-id`})
	for _, c := range cases {
		for _, tr := range []string{"kafka", "nats"} {
			d := one(t, vals, tr+" "+c.name)
			if code, detail := d.header("delay-error"), d.header("delay-error-detail"); code != c.code || !strings.Contains(detail, c.detail) {
				t.Errorf("%s %s: dead letter %q (%s), want %s saying %q", tr, c.name, code, detail, c.code, c.detail)
			}
		}
	}
}
