package shard

import (
	"testing"
)

func TestIndexEntryRoundTrip(t *testing.T) {
	for _, e := range []indexEntry{
		{Shard: 3, Fire: 1_800_000_000_000, Seq: 42, Order: order{Stamp: 1_700_000_000_000, Partition: 7, Offset: 99}},
		{Cancel: true, Shard: 0, Order: order{Stamp: -1, Partition: -1, Offset: -1}, Expiry: 123},
		{Shard: 65535, Fire: 0, Seq: 1<<64 - 1},
	} {
		var got indexEntry
		if err := decodeIndexEntry(appendIndexEntry(nil, &e), &got); err != nil || got != e {
			t.Fatalf("round trip of %+v: %+v, %v", e, got, err)
		}
	}
}

func TestKeysSortByTime(t *testing.T) {
	cases := []struct {
		a, b [3]int64 // shard, fire, seq
	}{
		{[3]int64{0, 1, 9}, [3]int64{0, 2, 1}},
		{[3]int64{0, 255, 1}, [3]int64{0, 256, 0}},
		{[3]int64{0, 1 << 40, 5}, [3]int64{0, 1 << 40, 6}},
		{[3]int64{1, 0, 0}, [3]int64{2, 0, 0}},
		{[3]int64{0, -5, 0}, [3]int64{0, 1, 0}}, // negative dues clamp to 0
	}
	for _, c := range cases {
		ka := string(appendTaskKey(nil, int(c.a[0]), c.a[1], uint64(c.a[2])))
		kb := string(appendTaskKey(nil, int(c.b[0]), c.b[1], uint64(c.b[2])))
		if ka >= kb {
			t.Fatalf("key %v sorts at or after %v", c.a, c.b)
		}
		sh, fire, seq, ok := parseTaskKey([]byte(ka))
		if !ok || sh != int(c.a[0]) || fire != max(c.a[1], 0) || seq != uint64(c.a[2]) {
			t.Fatalf("parse %v: %d %d %d %v", c.a, sh, fire, seq, ok)
		}
	}
}

func TestOrderNewerThan(t *testing.T) {
	cases := []struct {
		name    string
		in, old order
		newer   bool
	}{
		{"same partition later offset", order{1, 0, 11}, order{5, 0, 10}, true},
		{"same partition earlier offset", order{9, 0, 9}, order{5, 0, 10}, false},
		{"same partition same offset", order{9, 0, 10}, order{5, 0, 10}, false},
		{"other partition later stamp", order{6, 1, 0}, order{5, 0, 10}, true},
		{"other partition earlier stamp", order{4, 1, 99}, order{5, 0, 10}, false},
		{"other partition tie keeps existing", order{5, 1, 99}, order{5, 0, 10}, false},
	}
	for _, c := range cases {
		if got := c.in.newerThan(c.old); got != c.newer {
			t.Errorf("%s: newerThan = %v", c.name, got)
		}
	}
}

func FuzzDecodeIndexEntry(f *testing.F) {
	f.Add(appendIndexEntry(nil, &indexEntry{Shard: 1, Fire: 2, Seq: 3}))
	f.Add(appendIndexEntry(nil, &indexEntry{Cancel: true, Expiry: 9}))
	f.Add([]byte{})
	f.Add([]byte{1, 3})
	f.Fuzz(func(t *testing.T, b []byte) {
		var e indexEntry
		if err := decodeIndexEntry(b, &e); err != nil {
			return
		}
		if got := appendIndexEntry(nil, &e); string(got) != string(b) {
			t.Fatalf("re-encoding %x gave %x", b, got)
		}
	})
}

func FuzzParseExpiryKey(f *testing.F) {
	f.Add(appendExpiryKey(nil, 2, 1234, "src", "id"))
	f.Add([]byte{prefixExpiry})
	f.Fuzz(func(t *testing.T, b []byte) {
		parseExpiryKey(b)
		parseTaskKey(b)
	})
}
