package config_test

import (
	"fmt"

	"github.com/delaybridge/delaybridge/codec"
	"github.com/delaybridge/delaybridge/config"
)

func ExampleLoadBytes() {
	yml := `
data_dir: /var/lib/delaybridge
kafka:
  brokers: ["localhost:9092"]
  sources:
    - {topic: delay, dlq: delay.dlq}
`
	env := []string{
		"DELAYBRIDGE_KAFKA_BROKERS=a:9092,b:9092",
		"DELAYBRIDGE_MAX_DELAY=30d",
		"DELAYBRIDGE_NATS_SOURCES_0_SUBJECT=delay.>", // enables the nats block
		"DELAYBRIDGE_NATS_SOURCES_0_DLQ=dlq.delay",
	}
	c, err := config.LoadBytes([]byte(yml), env)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(c.Kafka.Brokers, c.Kafka.Group, c.MaxDelay, c.NATS.URL, c.NATS.Sources[0].Subject)
	// Output: [a:9092 b:9092] delaybridge 30d nats://localhost:4222 delay.>
}

func ExampleLoadBytes_errors() {
	yml := `
kafka:
  brokers: ["localhost:9092"]
  sources:
    - {topic: delay}
  grup: x
`
	_, err := config.LoadBytes([]byte(yml), []string{"DELAYBRIDGE_SHARD=4"})
	fmt.Println(err)
	_, err = config.LoadBytes([]byte(yml[:len(yml)-9]), nil)
	fmt.Println(err)
	// Output:
	// line 6: kafka.grup: unknown key
	// env DELAYBRIDGE_SHARD: names no configuration key
	// data_dir: required
	// kafka.sources[0].dlq: required
}

func ExampleConfig_AllowTarget() {
	c := &config.Config{Targets: config.Targets{Allow: []string{"kafka:orders.*", "nats:events.>"}}}
	fmt.Println(c.AllowTarget(codec.TransportKafka, "orders.created"))
	fmt.Println(c.AllowTarget(codec.TransportKafka, "orders.eu.created")) // "*" stays within one dot-separated token
	fmt.Println(c.AllowTarget(codec.TransportNATS, "orders.created"))     // kafka: pattern
	fmt.Println(c.AllowTarget(codec.TransportNATS, "events.eu.created"))  // ">" spans tokens
	// Output:
	// true
	// false
	// false
	// true
}
