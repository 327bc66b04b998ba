package shard

import (
	"context"
	"encoding/binary"
	"errors"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"go.uber.org/zap"
)

// TestStoreFormat: the store records its format; a store of a newer one
// is refused at open with ErrStoreFormat, naming both formats, rather than
// misread record by record (a release without held tasks loaded them as
// due in millions of years, found by an upgrade hunt); a store written
// before the record existed gets it; a corrupt record is an error.
func TestStoreFormat(t *testing.T) {
	for _, tc := range []struct {
		name    string
		value   []byte // nil: the key deleted
		wantErr string // "" opens
		isFmt   bool
	}{
		{"this format", binary.BigEndian.AppendUint16(nil, storeFormat), "", false},
		{"written before the record", nil, "", false},
		{"newer", binary.BigEndian.AppendUint16(nil, storeFormat+1), "format 2, this binary reads up to 1", true},
		{"corrupt", []byte{1, 2, 3}, "corrupt store format record (3 bytes)", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			e, err := Open(Options{Dir: dir, Logger: zap.NewNop()})
			if err != nil {
				t.Fatal(err)
			}
			e.Close()
			db, err := openPebble(context.Background(), dir, nil, zap.NewNop(), 0, 0, nil, 0, false)
			if err != nil {
				t.Fatal(err)
			}
			if v, found, err := getCopy(db, formatKey); err != nil || !found || binary.BigEndian.Uint16(v) != storeFormat {
				t.Fatalf("a new store's format record: %v %v %v", v, found, err)
			}
			if tc.value == nil {
				err = db.Delete(formatKey, pebble.Sync)
			} else {
				err = db.Set(formatKey, tc.value, pebble.Sync)
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := db.Close(); err != nil {
				t.Fatal(err)
			}

			e, err = Open(Options{Dir: dir, Logger: zap.NewNop()})
			if tc.wantErr != "" {
				if err == nil {
					e.Close()
					t.Fatal("opened")
				}
				if !strings.Contains(err.Error(), tc.wantErr) || errors.Is(err, ErrStoreFormat) != tc.isFmt {
					t.Fatalf("err %v, want %q (ErrStoreFormat %v)", err, tc.wantErr, tc.isFmt)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			v, found, err := getCopy(e.db, formatKey)
			e.Close()
			if err != nil || !found || binary.BigEndian.Uint16(v) != storeFormat {
				t.Fatalf("format record after open: %v %v %v", v, found, err)
			}
		})
	}
}

// TestFresh: Engine.Fresh is true only for a store Open created (an
// empty directory, or a store holding no key at all), not for a reopen
// nor for a store written before the format record existed.
func TestFresh(t *testing.T) {
	open := func(t *testing.T, dir string) *Engine {
		t.Helper()
		e, err := Open(Options{Dir: dir, Logger: zap.NewNop()})
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	// edit rewrites the closed store in dir with Pebble directly.
	edit := func(t *testing.T, dir string, f func(db *pebble.DB) error) {
		t.Helper()
		db, err := openPebble(context.Background(), dir, nil, zap.NewNop(), 0, 0, nil, 0, false)
		if err != nil {
			t.Fatal(err)
		}
		if err := f(db); err != nil {
			t.Fatal(err)
		}
		if err := db.Close(); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name  string
		prep  func(t *testing.T, dir string) // nil: a new directory
		fresh bool
	}{
		{"new directory", nil, true},
		{"reopened", func(t *testing.T, dir string) { open(t, dir).Close() }, false},
		{"written before the format record", func(t *testing.T, dir string) {
			open(t, dir).Close()
			edit(t, dir, func(db *pebble.DB) error { return db.Delete(formatKey, pebble.Sync) })
		}, false},
		{"holding no key", func(t *testing.T, dir string) {
			open(t, dir).Close()
			edit(t, dir, func(db *pebble.DB) error {
				return db.DeleteRange([]byte{0}, []byte{0xff, 0xff}, pebble.Sync)
			})
		}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			if tc.prep != nil {
				tc.prep(t, dir)
			}
			e := open(t, dir)
			defer e.Close()
			if e.Fresh() != tc.fresh {
				t.Fatalf("Fresh() = %v, want %v", e.Fresh(), tc.fresh)
			}
		})
	}
}
