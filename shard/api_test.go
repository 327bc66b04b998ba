package shard

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// TestTimeJSON: the admin API's times read as delay-due does, three
// fractional digits in UTC, and zero fields stay out with omitzero.
func TestTimeJSON(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   any
		want string
	}{
		{"whole second", TaskInfo{Due: msTime(1795359845000), NextFire: msTime(1795359845000)},
			`"due":"2026-11-22T15:04:05.000Z","next_fire":"2026-11-22T15:04:05.000Z"`},
		{"trailing zero kept", TaskInfo{Due: msTime(1795359845120), NextFire: msTime(1795359845123)},
			`"due":"2026-11-22T15:04:05.120Z","next_fire":"2026-11-22T15:04:05.123Z"`},
		{"not UTC", TaskInfo{Due: Time{time.UnixMilli(1795359845120).In(time.FixedZone("x", 3600))}},
			`"due":"2026-11-22T15:04:05.120Z"`},
		{"epoch", TaskInfo{Due: msTime(0)}, `"due":"1970-01-01T00:00:00.000Z"`},
		{"stats omit zero", ShardStats{Shard: 1}, `{"shard":1,"pending":0,"in_wheel":0,"held":0}`},
		{"stats set", ShardStats{NextDue: msTime(1795359845001), OldestOverdue: msTime(1795359845010)},
			`"next_due":"2026-11-22T15:04:05.001Z","oldest_overdue":"2026-11-22T15:04:05.010Z"`},
		{"stuck due", StuckEntry{NextFire: msTime(1795359845100), Due: msTime(1795359845000)},
			`"next_fire":"2026-11-22T15:04:05.100Z"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := json.Marshal(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(b), tc.want) {
				t.Errorf("json %s, want it to hold %s", b, tc.want)
			}
		})
	}
	if _, err := json.Marshal(Time{time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)}); err == nil {
		t.Error("a year past 9999 marshalled without an error")
	}
}
