// Command probe runs one check inside a test sandbox:
//
//	probe inotify N   create inotify instances until the kernel refuses one
//	                  (or N), print "<count> <reason>", then hold them
//	probe icmp        open an ICMP datagram socket (unprivileged ping)
package main

import (
	"fmt"
	"os"
	"strconv"
	"syscall"
	"time"
)

func main() {
	switch os.Args[1] {
	case "inotify":
		limit, _ := strconv.Atoi(os.Args[2])
		n, reason := 0, "cap reached"
		for n < limit {
			if _, err := syscall.InotifyInit1(0); err != nil {
				reason = err.Error()
				break
			}
			n++
		}
		fmt.Printf("%d %s\n", n, reason)
		// Held so the instances stay charged while the test probes.
		time.Sleep(time.Hour)
	case "icmp":
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_DGRAM, syscall.IPPROTO_ICMP)
		if err != nil {
			fmt.Println("icmp socket:", err)
			os.Exit(1)
		}
		syscall.Close(fd)
		fmt.Println("icmp socket ok")
	}
}
