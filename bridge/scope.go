package bridge

import (
	"strconv"

	"github.com/delaybridge/delaybridge/shard"
)

// A Kafka delay topic and the NATS delay stream name the scope of their
// task ids alike (codec.Task.Source: the topic, the stream), and the
// config refuses a topic and the stream of the same name, but a store may
// read the NATS stream "delay" in one run and the Kafka topic "delay" in
// the next, or the other way round: the tasks the first left pending and
// the messages of the second then share a scope, and a replace or cancel
// of the second must be ordered against the first's tasks. The engine
// orders two messages of one partition and incarnation by offset and all
// others by broker time (shard: order.newerThan); NATS messages are all
// partition 0, so partition 0 of a Kafka topic named like a stream the
// store has read (and the stream named like a topic whose partition 0 it
// has read) takes an incarnation the other never has: the other's with
// CrossIncarnation flipped. Each counts on from there when its log is
// replaced (one more each time), so the two never meet. Before, a stream
// sequence and a Kafka offset were compared as offsets of one log, and a
// replace from the second transport below the first's position was
// dropped as older (never delivered), a cancel ignored.
const CrossIncarnation uint32 = 1 << 31

// KafkaCheckpointKey is the store checkpoint key of a Kafka topic
// partition (the bridge/kafka source's position).
func KafkaCheckpointKey(topic string, partition int) string {
	return "kafka|" + topic + "|" + strconv.Itoa(partition)
}

// NATSIncarnationKey is the store checkpoint key under which the
// bridge/nats source keeps the incarnation of a stream: Offset is the
// incarnation, Fingerprint the stream's creation time.
func NATSIncarnationKey(stream string) string { return "nats-incarnation|" + stream }

// StreamCrossIncarnation is the incarnation of partition 0 of the Kafka
// topic named like stream when the store holds no checkpoint of that
// partition: ok when the store has read a NATS stream of that name, and
// then that stream's incarnation with CrossIncarnation flipped.
func StreamCrossIncarnation(h Handler, stream string) (inc uint32, ok bool, err error) {
	cp, ok, err := loadOther(h, NATSIncarnationKey(stream))
	return uint32(cp.Offset) ^ CrossIncarnation, ok, err // its Offset is the incarnation
}

// TopicCrossIncarnation is the incarnation of the NATS stream named like
// topic when the store holds none of the stream: ok when the store has
// read partition 0 of a Kafka topic of that name, and then that
// partition's incarnation with CrossIncarnation flipped.
func TopicCrossIncarnation(h Handler, topic string) (inc uint32, ok bool, err error) {
	cp, ok, err := loadOther(h, KafkaCheckpointKey(topic, 0))
	return cp.Incarnation ^ CrossIncarnation, ok, err
}

// loadOther loads key's checkpoint; not found with a Handler that keeps no
// whole checkpoints (nor incarnations, then).
func loadOther(h Handler, key string) (shard.Checkpoint, bool, error) {
	l, can := h.(CheckpointLoader)
	if !can {
		return shard.Checkpoint{}, false, nil
	}
	return l.LoadCheckpoint(key)
}
