package objstore

import (
	"os"
	"path/filepath"
	"testing"
)

// TestDataExtents: the chunks export reads are those SEEK_DATA finds data
// in; a sparse file's holes are not read. The control: a file written in
// full has one extent covering it.
func TestDataExtents(t *testing.T) {
	dir := t.TempDir()
	sparse, err := os.Create(filepath.Join(dir, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	defer sparse.Close()
	const size = 64 << 20
	if err := sparse.Truncate(size); err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, 20 << 20, size - 4096} {
		if _, err := sparse.WriteAt([]byte("data"), off); err != nil {
			t.Fatal(err)
		}
	}
	ext := dataExtents(sparse, size)
	if ext == nil {
		t.Skip("this file system cannot tell data from holes (SEEK_DATA)")
	}
	var data int64
	for _, e := range ext {
		data += e[1] - e[0]
	}
	t.Logf("sparse file of %d MiB: extents %v (%d KiB of data)", size>>20, ext, data>>10)
	if len(ext) != 3 || data > 1<<20 {
		t.Errorf("extents %v: want the three written blocks only", ext)
	}

	full, err := os.Create(filepath.Join(dir, "full"))
	if err != nil {
		t.Fatal(err)
	}
	defer full.Close()
	if _, err := full.Write(make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	if ext := dataExtents(full, 1<<20); len(ext) != 1 || ext[0] != [2]int64{0, 1 << 20} {
		t.Errorf("file written in full: extents %v, want [[0 1048576]]", ext)
	}
}
