package service

import (
	"testing"

	"github.com/delaybridge/delaybridge/config"
	"github.com/delaybridge/delaybridge/shard"
)

// The config package documents the store's memory defaults; the engine
// applies its own when a size is zero. They must be the same numbers.
func TestStoreDefaultsAgree(t *testing.T) {
	if got, want := int64(config.DefaultStoreCacheMB)<<20, int64(shard.DefaultCacheBytes); got != want {
		t.Errorf("config store.cache_mb default %d B, engine default %d B", got, want)
	}
	if got, want := int64(config.DefaultStoreMemtableMB)<<20, int64(shard.DefaultMemTableBytes); got != want {
		t.Errorf("config store.memtable_mb default %d B, engine default %d B", got, want)
	}
}
