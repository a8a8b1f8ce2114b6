package cubeletapi

import (
	"net/http"
	"net/http/pprof"
)

// registerPprof mounts the runtime profiler on mux ([api] pprof = true).
// It is registered explicitly rather than through the package's init on
// http.DefaultServeMux, so a cubelet never serves profiles unless asked.
func registerPprof(mux *http.ServeMux) {
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
}
