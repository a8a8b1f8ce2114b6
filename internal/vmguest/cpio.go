package vmguest

import (
	"fmt"
	"io"
)

// cpioWriter writes the "newc" (SVR4, no CRC) cpio format, the only one
// the kernel's initramfs unpacker accepts. It is a handful of lines, so it
// is written here rather than pulled in as a dependency.
type cpioWriter struct {
	w   io.Writer
	ino uint32
	n   int64 // bytes written, for padding
}

// cpio mode bits (the kernel reads the full st_mode).
const (
	cpioDir     = 0o040000
	cpioFile    = 0o100000
	cpioSymlink = 0o120000
	cpioChar    = 0o020000
)

func (c *cpioWriter) write(b []byte) error {
	n, err := c.w.Write(b)
	c.n += int64(n)
	return err
}

func (c *cpioWriter) pad() error {
	if r := c.n % 4; r != 0 {
		return c.write(make([]byte, 4-r))
	}
	return nil
}

// entry writes one header, the name and the data, each padded to 4 bytes.
func (c *cpioWriter) entry(name string, mode uint32, rdevMajor, rdevMinor uint32, data []byte) error {
	c.ino++
	nlink := uint32(1)
	if mode&0o170000 == cpioDir {
		nlink = 2
	}
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdevMajor, rdevMinor, len(name)+1, 0)
	if err := c.write([]byte(hdr)); err != nil {
		return err
	}
	if err := c.write(append([]byte(name), 0)); err != nil {
		return err
	}
	if err := c.pad(); err != nil {
		return err
	}
	if err := c.write(data); err != nil {
		return err
	}
	return c.pad()
}

func (c *cpioWriter) dir(name string) error { return c.entry(name, cpioDir|0o755, 0, 0, nil) }

func (c *cpioWriter) file(name string, perm uint32, data []byte) error {
	return c.entry(name, cpioFile|perm, 0, 0, data)
}

func (c *cpioWriter) symlink(name, target string) error {
	return c.entry(name, cpioSymlink|0o777, 0, 0, []byte(target))
}

func (c *cpioWriter) char(name string, perm, major, minor uint32) error {
	return c.entry(name, cpioChar|perm, major, minor, nil)
}

// close writes the trailer the unpacker stops at.
func (c *cpioWriter) close() error {
	return c.entry("TRAILER!!!", 0, 0, 0, nil)
}
