// Package fault is the fault suite of delaybridge: it proves the durability
// and "nothing blocks" rules of the contract (CONTRACT §3, §4) against the
// process as shipped. The tests build the delaybridge binary once, run real
// brokers in the test process (kfake for Kafka, nats-server with JetStream)
// and drive the bridge as a child process: kill -9 under load (also of one
// of two bridges sharing the Kafka group and the NATS consumer, and
// repeatedly through an outage of the target broker), broker outages, bad
// input. Store write errors and wall-clock steps are tested in
// process through bridge/service, where a failing file system and a fake
// clock can be injected.
//
// The short form runs in CI; DELAYBRIDGE_LONG=1 runs the long form (more
// kill rounds, 30 s outages, 10 k bad messages).
//
// One gap of kfake is filled by the harness: a consumer-group member killed
// while its JoinGroup waited gets no session timer there and keeps its
// partitions, where Kafka expires it one session timeout later.
// sessionExpiry removes such members (see its comment).
package fault
