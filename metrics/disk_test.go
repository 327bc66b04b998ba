package metrics

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// TestStoreDiskCollector: nothing is exported until a store installs its
// function, then its values at each scrape (the volume's only when it
// could be read), and nothing again once it is removed.
func TestStoreDiskCollector(t *testing.T) {
	r := prometheus.NewRegistry()
	m := New(r)
	gauges := func() map[string]float64 {
		t.Helper()
		mfs, err := r.Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, mf := range mfs {
			switch n := mf.GetName(); n {
			case "delaybridge_store_disk_free_bytes", "delaybridge_store_disk_size_bytes", "delaybridge_store_disk_free_inodes",
				"delaybridge_store_disk_inodes", "delaybridge_store_disk_reserve_bytes", "delaybridge_store_bytes":
				out[n] = mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return out
	}
	if g := gauges(); len(g) != 0 {
		t.Fatalf("exported %v with no store", g)
	}
	d := StoreDisk{Volume: true, FreeBytes: 5, SizeBytes: 10, FreeInodes: 3, Inodes: 4, ReserveBytes: 2, StoreBytes: 1}
	unset := m.StoreDisk.Set(func() StoreDisk { return d })
	want := map[string]float64{
		"delaybridge_store_disk_free_bytes": 5, "delaybridge_store_disk_size_bytes": 10,
		"delaybridge_store_disk_free_inodes": 3, "delaybridge_store_disk_inodes": 4,
		"delaybridge_store_disk_reserve_bytes": 2, "delaybridge_store_bytes": 1,
	}
	if g := gauges(); len(g) != len(want) {
		t.Fatalf("exported %v, want %v", g, want)
	} else {
		for k, v := range want {
			if g[k] != v {
				t.Errorf("%s = %v, want %v", k, g[k], v)
			}
		}
	}
	d.Volume = false // statfs failed: the store's own size only
	if g := gauges(); len(g) != 2 || g["delaybridge_store_bytes"] != 1 {
		t.Fatalf("exported %v with no volume, want the store's size and reserve only", g)
	}
	// A later store's function is not removed by an earlier one's unset.
	unset2 := m.StoreDisk.Set(func() StoreDisk { return StoreDisk{StoreBytes: 7} })
	unset()
	if g := gauges(); g["delaybridge_store_bytes"] != 7 {
		t.Fatalf("exported %v after the first store's unset, want the second's", g)
	}
	unset2()
	if g := gauges(); len(g) != 0 {
		t.Fatalf("exported %v after unset", g)
	}
}
