package service

import (
	"testing"
	"time"

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
	if got, want := config.DefaultFireBatchBytes, shard.DefaultFireBatchBytes; got != want {
		t.Errorf("config fire_batch_bytes default %d B, engine default %d B", got, want)
	}
}

// A zero in the config is an explicit choice (the config holds the defaults
// already); it must reach the engine as its "none", not as its "default".
func TestEngineOptionsKeepExplicitZeros(t *testing.T) {
	const base = "data_dir: /tmp/x\nkafka:\n  brokers: [\"localhost:9092\"]\n  sources:\n    - {topic: delay, dlq: delay.dlq}\nadmin: {listen: \"127.0.0.1:8080\"}\n"
	cases := []struct {
		name          string
		yaml          string
		env           []string
		wantJitter    float64
		wantRetention time.Duration
		// wantWaiting: Options.OutageMemory, per shard (8 by default)
		wantWaiting int
	}{
		{"defaults", "", nil, 0.2, 24 * time.Hour, 65536},
		{"yaml zeros", "retry: {jitter: 0, waiting_in_memory: 0}\ncancel_retention: 0s\n", nil, -1, -1, -1},
		{"env zeros", "", []string{"DELAYBRIDGE_RETRY_JITTER=0", "DELAYBRIDGE_CANCEL_RETENTION=0s", "DELAYBRIDGE_RETRY_WAITING_IN_MEMORY=0"}, -1, -1, -1},
		{"explicit values", "retry: {jitter: 0.5, waiting_in_memory: 17}\ncancel_retention: 2h\n", nil, 0.5, 2 * time.Hour, 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.LoadBytes([]byte(base+tc.yaml), tc.env)
			if err != nil {
				t.Fatal(err)
			}
			eo := engineOptions(cfg)
			if eo.Retry.Jitter != tc.wantJitter {
				t.Errorf("Retry.Jitter = %g, want %g", eo.Retry.Jitter, tc.wantJitter)
			}
			if eo.OutageMemory != tc.wantWaiting {
				t.Errorf("OutageMemory = %d, want %d", eo.OutageMemory, tc.wantWaiting)
			}
			if eo.CancelRetention != tc.wantRetention {
				t.Errorf("CancelRetention = %s, want %s", eo.CancelRetention, tc.wantRetention)
			}
			if eo.Dir != "/tmp/x" || eo.Shards != cfg.Shards || eo.FireBatch != cfg.FireBatch || eo.FireBatchBytes != cfg.FireBatchBytes {
				t.Errorf("options %+v do not carry the config", eo)
			}
		})
	}
}
