package runc

import "time"

// RemoveCgroup removes cgroupPath from every cgroup hierarchy (v1
// controllers, named hierarchies and cgroup2), retrying EBUSY for up to
// timeout while the kernel releases the last task. It returns the
// directories it found. Other OCI drivers (gvisor) share it: runsc, like
// runc, can leave hierarchy directories behind on hybrid hosts.
func RemoveCgroup(cgroupPath string, timeout time.Duration) ([]string, error) {
	return removeCgroup(cgroupPath, timeout)
}

// CgroupDirs lists the directories of cgroupPath that exist in any
// hierarchy (for leak checks in other drivers' tests).
func CgroupDirs(cgroupPath string) ([]string, error) { return cgroupDirs(cgroupPath) }
