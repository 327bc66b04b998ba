package shard

import (
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/delaybridge/delaybridge/codec"
)

// TestOutageOutcomeByGroup: a lane's transport is in an outage while any
// of its target groups is down, and only a delivery to a target of that
// group, in a batch that fails none of it, ends the group's outage (hunt
// H177: the record was per transport, so one Kafka topic that could not
// take writes among healthy ones was "reachable again" at every healthy
// delivery and "unreachable" at its next retry). One Warn when the
// transport's first group goes down, one Info when its last comes back.
func TestOutageOutcomeByGroup(t *testing.T) {
	down := errors.New("not enough replicas: " + ErrUnavailable.Error())
	type batch struct {
		at     time.Duration // since t0
		failed []string      // targets of tasks that failed as unavailable
		acked  []string      // targets of tasks delivered that waited for an outage
		fresh  []string      // targets of tasks delivered that did not wait
	}
	for _, tc := range []struct {
		name      string
		batches   []batch
		wantDown  bool
		warn, inf int
	}{
		{"one target down, others delivered", []batch{
			{0, []string{"a"}, nil, nil}, {time.Second, nil, []string{"b"}, nil}, {2 * time.Second, []string{"a"}, []string{"c"}, nil}, {3 * time.Second, nil, []string{"b", "c"}, nil},
		}, true, 1, 0},
		{"the down target delivered", []batch{
			{0, []string{"a"}, nil, nil}, {time.Second, nil, []string{"b"}, nil}, {2 * time.Second, nil, []string{"a"}, nil},
		}, false, 1, 1},
		{"target partly down: delivered and failed in one batch", []batch{
			{0, []string{"a"}, nil, nil}, {time.Second, []string{"a"}, []string{"a"}, nil},
		}, true, 1, 0},
		{"two targets down, one back", []batch{
			{0, []string{"a", "b"}, nil, nil}, {time.Second, nil, []string{"a"}, nil},
		}, true, 1, 0},
		{"two targets down, both back", []batch{
			{0, []string{"a", "b"}, nil, nil}, {time.Second, nil, []string{"a"}, nil}, {2 * time.Second, nil, []string{"b"}, nil},
		}, false, 1, 1},
		{"down again after coming back", []batch{
			{0, []string{"a"}, nil, nil}, {time.Second, nil, []string{"a"}, nil}, {2 * time.Second, []string{"a"}, nil, nil},
		}, true, 2, 1},
		{"a group not failing for twice retry.max is stale", []batch{
			{0, []string{"a"}, nil, nil}, {time.Second, nil, []string{"b"}, nil}, {2*time.Minute + 2*time.Second, nil, []string{"b"}, nil},
		}, false, 1, 1},
		// Hunt H180: a Kafka topic with one partition without a leader.
		// New tasks to its other partitions never waited: their delivery
		// says nothing of the tasks that wait.
		{"target partly down: a task that did not wait delivered", []batch{
			{at: 0, failed: []string{"a"}}, {at: time.Second, fresh: []string{"a"}}, {at: 2 * time.Second, failed: []string{"a"}},
			{at: 3 * time.Second, fresh: []string{"a", "b"}},
		}, true, 1, 0},
		{"a task that did not wait delivered after retry.max without a failure", []batch{
			{at: 0, failed: []string{"a"}}, {at: time.Second, fresh: []string{"a"}}, {at: time.Minute + 2*time.Second, fresh: []string{"a"}},
		}, false, 1, 1},
		{"deliveries outside an outage", []batch{
			{0, nil, []string{"a"}, nil}, {time.Second, nil, []string{"b"}, nil},
		}, false, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			core, logs := observer.New(zap.InfoLevel)
			h := newHarness(t, func(o *Options) {
				o.Shards = 1
				o.Logger = zap.New(core)
				o.Retry.Max = time.Minute
			})
			if heldGroup(0, "a") == heldGroup(0, "b") || heldGroup(0, "a") == heldGroup(0, "c") || heldGroup(0, "b") == heldGroup(0, "c") {
				t.Fatal("test targets share a group")
			}
			s := h.e.shards[0]
			slot := transportSlot(codec.TransportKafka)
			o := &s.lanes[slot].outage
			for _, b := range tc.batches {
				var items []fireItem
				var acked []int
				var downGroups []int64
				for _, tg := range b.failed {
					items = append(items, fireItem{task: &codec.Task{Transport: codec.TransportKafka, Target: tg}})
					downGroups = appendGroup(downGroups, heldGroup(slot, tg))
				}
				var upGroups []int64
				for _, tg := range b.acked {
					acked = append(acked, len(items))
					items = append(items, fireItem{task: &codec.Task{Transport: codec.TransportKafka, Target: tg}})
					upGroups = appendGroup(upGroups, heldGroup(slot, tg))
				}
				for _, tg := range b.fresh {
					acked = append(acked, len(items))
					items = append(items, fireItem{task: &codec.Task{Transport: codec.TransportKafka, Target: tg}})
				}
				var outageErr error
				if len(b.failed) > 0 {
					outageErr = down
				}
				s.mu.Lock()
				if outageErr != nil || o.err != nil {
					s.outageOutcomeLocked(o, codec.TransportKafka, items, acked, upGroups, downGroups, outageErr, len(b.failed), ms(t0.Add(b.at)), ms(t0.Add(b.at)))
				}
				s.mu.Unlock()
			}
			s.mu.Lock()
			gotDown := o.err != nil
			s.mu.Unlock()
			warn := logs.FilterMessageSnippet("target broker unreachable").Len()
			inf := logs.FilterMessageSnippet("target broker reachable again").Len()
			if gotDown != tc.wantDown || warn != tc.warn || inf != tc.inf {
				t.Errorf("in an outage %v, %d Warn, %d Info; want %v, %d, %d", gotDown, warn, inf, tc.wantDown, tc.warn, tc.inf)
			}
		})
	}
}
