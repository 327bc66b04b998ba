package config

import (
	"strings"
	"testing"
)

// TestKafkaFetchMemory: kafka.fetch_memory_mb defaults to
// DefaultKafkaFetchMemoryMB, takes a value from the file or the
// environment, and refuses 0, negatives and values past 64 GiB by its
// name (and the variable that set it).
func TestKafkaFetchMemory(t *testing.T) {
	const base = "data_dir: /var/lib/delaybridge\nadmin: {listen: 127.0.0.1:8080}\nkafka:\n  brokers: [\"localhost:9092\"]\n  sources: [{topic: delay, dlq: delay.dlq}]\n"
	for _, tc := range []struct {
		name    string
		yml     string
		env     []string
		want    int
		wantErr string
	}{
		{"default", "", nil, DefaultKafkaFetchMemoryMB, ""},
		{"set", "  fetch_memory_mb: 256\n", nil, 256, ""},
		{"from env", "  fetch_memory_mb: 256\n", []string{"DELAYBRIDGE_KAFKA_FETCH_MEMORY_MB=8"}, 8, ""},
		{"null is omitted", "  fetch_memory_mb: null\n", nil, DefaultKafkaFetchMemoryMB, ""},
		{"zero", "  fetch_memory_mb: 0\n", nil, 0, "kafka.fetch_memory_mb: must be between 1 and 65536 (MiB), got 0"},
		{"negative from env", "", []string{"DELAYBRIDGE_KAFKA_FETCH_MEMORY_MB=-1"}, 0, "kafka.fetch_memory_mb (from DELAYBRIDGE_KAFKA_FETCH_MEMORY_MB): must be between 1 and 65536"},
		{"too large", "  fetch_memory_mb: 65537\n", nil, 0, "kafka.fetch_memory_mb: must be between 1 and 65536 (MiB), got 65537"},
		{"not a number", "  fetch_memory_mb: lots\n", nil, 0, "fetch_memory_mb"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := LoadBytes([]byte(base+tc.yml), tc.env)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Kafka.FetchMemoryMB != tc.want {
				t.Fatalf("fetch_memory_mb %d, want %d", c.Kafka.FetchMemoryMB, tc.want)
			}
		})
	}
	if Default().Kafka != nil {
		t.Fatal("Default holds a kafka block")
	}
}
