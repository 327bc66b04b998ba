package metrics

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// StoreDisk is what the open store reports of its disk at a scrape.
type StoreDisk struct {
	// Volume is true when the volume of data_dir could be read (statfs):
	// the volume fields are exported only then.
	Volume bool
	// FreeBytes and FreeInodes are what an unprivileged process may still
	// use (statfs f_bavail and f_ffree); SizeBytes and Inodes the totals.
	FreeBytes, SizeBytes, FreeInodes, Inodes uint64
	// ReserveBytes is store.reserve_mb in bytes (0: no reserve).
	ReserveBytes uint64
	// StoreBytes is the space the store's own files take (WAL, tables,
	// blob files, manifest, obsolete files not yet deleted).
	StoreBytes uint64
}

// StoreDiskCollector exports the store's disk space, read when scraped
// from the function the open engine installed (Set); nothing while no
// store is open.
type StoreDiskCollector struct {
	src                                            atomic.Pointer[func() StoreDisk]
	free, size, freeInodes, inodes, reserve, store *prometheus.Desc
}

func newStoreDiskCollector() *StoreDiskCollector {
	return &StoreDiskCollector{
		free: prometheus.NewDesc("delaybridge_store_disk_free_bytes",
			"Bytes free for the bridge (not counting the root-reserved blocks) on the volume holding data_dir, read at each scrape. Below store.reserve_mb (delaybridge_store_disk_reserve_bytes) the bridge stops taking messages in until there is room again.", nil, nil),
		size: prometheus.NewDesc("delaybridge_store_disk_size_bytes",
			"Size of the volume holding data_dir.", nil, nil),
		freeInodes: prometheus.NewDesc("delaybridge_store_disk_free_inodes",
			"Inodes free on the volume holding data_dir (0 with delaybridge_store_disk_inodes 0: the file system does not count them).", nil, nil),
		inodes: prometheus.NewDesc("delaybridge_store_disk_inodes",
			"Inodes of the volume holding data_dir.", nil, nil),
		reserve: prometheus.NewDesc("delaybridge_store_disk_reserve_bytes",
			"store.reserve_mb in bytes: while the volume has less free, the bridge takes no message in (fires and deletes go on). 0: no reserve.", nil, nil),
		store: prometheus.NewDesc("delaybridge_store_bytes",
			"Disk space the store's files take on the volume, as du counts it: write-ahead logs (with what Pebble preallocated for them), tables, blob files, manifest and files not yet deleted.", nil, nil),
	}
}

// Set installs the function a scrape reads; the returned func removes it
// again (if it is still the one installed).
func (c *StoreDiskCollector) Set(f func() StoreDisk) (unset func()) {
	p := &f
	c.src.Store(p)
	return func() { c.src.CompareAndSwap(p, nil) }
}

// Describe implements prometheus.Collector.
func (c *StoreDiskCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.free, c.size, c.freeInodes, c.inodes, c.reserve, c.store} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *StoreDiskCollector) Collect(ch chan<- prometheus.Metric) {
	p := c.src.Load()
	if p == nil {
		return
	}
	d := (*p)()
	gauge := func(desc *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, float64(v))
	}
	if d.Volume {
		gauge(c.free, d.FreeBytes)
		gauge(c.size, d.SizeBytes)
		gauge(c.freeInodes, d.FreeInodes)
		gauge(c.inodes, d.Inodes)
	}
	gauge(c.reserve, d.ReserveBytes)
	gauge(c.store, d.StoreBytes)
}
