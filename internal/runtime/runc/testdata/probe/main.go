// Command probe runs one check inside a test sandbox:
//
//	probe inotify N   create inotify instances until the kernel refuses one
//	                  (or N), print "<count> <reason>", then hold them
//	probe inotify-uids K N
//	                  the same as each of the UIDs 1..K in turn (up to N
//	                  each), print the total
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
	case "inotify-uids":
		k, _ := strconv.Atoi(os.Args[2])
		limit, _ := strconv.Atoi(os.Args[3])
		total := 0
		for uid := 1; uid <= k; uid++ {
			// The saved UID stays 0, so the probe can come back.
			if err := syscall.Setresuid(uid, uid, 0); err != nil {
				fmt.Println("setresuid:", err)
				os.Exit(1)
			}
			for n := 0; n < limit; n++ {
				if _, err := syscall.InotifyInit1(0); err != nil {
					break
				}
				total++
			}
			if err := syscall.Setresuid(0, 0, 0); err != nil {
				fmt.Println("setresuid back:", err)
				os.Exit(1)
			}
		}
		fmt.Printf("%d as %d users\n", total, k)
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
