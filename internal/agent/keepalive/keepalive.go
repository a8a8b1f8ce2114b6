// Package keepalive reads how often a client of a streaming envd RPC wants
// keepalive events on an otherwise quiet stream (the E2B SDKs ask for one
// every 50 s, so proxies and load balancers never see an idle connection).
package keepalive

import (
	"net/http"
	"strconv"
	"time"
)

// Header carries the interval in seconds.
const Header = "Keepalive-Ping-Interval"

// Default applies when the client names no interval.
const Default = 50 * time.Second

// Interval reads the client's wish, clamped to [1s, 1h].
func Interval(h http.Header) time.Duration {
	secs, err := strconv.Atoi(h.Get(Header))
	if err != nil || secs <= 0 {
		return Default
	}
	return min(time.Duration(secs)*time.Second, time.Hour)
}
