// Command dns is hack/kube-up.sh's cluster DNS: it answers A queries for
// <service>.<namespace>.svc.<domain> with the addresses of the Service's
// ready endpoints (read from the API server every second), as a headless
// Service answers, so that the test cluster needs neither CoreDNS nor
// kube-proxy. Other names get NXDOMAIN. It stops on SIGTERM.
//
//	dns --kubeconfig FILE --listen 172.30.0.1:53 [--domain cluster.local]
package main

import (
	"context"
	"flag"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/miekg/dns"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "the API server's kubeconfig")
	listen := flag.String("listen", "127.0.0.1:53", "UDP and TCP address to serve on")
	domain := flag.String("domain", "cluster.local", "the cluster domain")
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		log.Error("kubeconfig", "error", err)
		os.Exit(1)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		log.Error("client", "error", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	z := &zone{suffix: ".svc." + strings.TrimSuffix(*domain, ".") + "."}
	go z.refresh(ctx, cs, log)
	mux := dns.NewServeMux()
	mux.HandleFunc(".", z.serve)
	var servers []*dns.Server
	for _, netw := range []string{"udp", "tcp"} {
		s := &dns.Server{Addr: *listen, Net: netw, Handler: mux}
		servers = append(servers, s)
		go func() {
			if err := s.ListenAndServe(); err != nil {
				log.Error("serve", "net", netw, "error", err)
				stop()
			}
		}()
	}
	log.Info("serving", "listen", *listen, "suffix", z.suffix)
	<-ctx.Done()
	for _, s := range servers {
		_ = s.Shutdown()
	}
}

type zone struct {
	suffix string
	mu     sync.RWMutex
	names  map[string][]net.IP // "svc.ns" -> ready endpoint addresses
}

func (z *zone) refresh(ctx context.Context, cs *kubernetes.Clientset, log *slog.Logger) {
	for ctx.Err() == nil {
		list, err := cs.DiscoveryV1().EndpointSlices("").List(ctx, metav1.ListOptions{})
		if err != nil {
			log.Warn("list endpoint slices", "error", err)
		} else {
			names := map[string][]net.IP{}
			for _, s := range list.Items {
				svc := s.Labels[discoveryv1.LabelServiceName]
				if svc == "" || s.AddressType != discoveryv1.AddressTypeIPv4 {
					continue
				}
				for _, e := range s.Endpoints {
					if e.Conditions.Ready != nil && !*e.Conditions.Ready {
						continue
					}
					for _, a := range e.Addresses {
						if ip := net.ParseIP(a); ip != nil {
							names[svc+"."+s.Namespace] = append(names[svc+"."+s.Namespace], ip)
						}
					}
				}
			}
			z.mu.Lock()
			z.names = names
			z.mu.Unlock()
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

func (z *zone) serve(w dns.ResponseWriter, r *dns.Msg) {
	m := new(dns.Msg)
	m.SetReply(r)
	m.Authoritative = true
	for _, q := range r.Question {
		name := strings.ToLower(q.Name)
		key, ok := strings.CutSuffix(name, z.suffix)
		if !ok {
			continue
		}
		z.mu.RLock()
		ips := z.names[key]
		z.mu.RUnlock()
		if q.Qtype != dns.TypeA {
			continue
		}
		for _, ip := range ips {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 1}, A: ip})
		}
	}
	if len(m.Answer) == 0 {
		m.Rcode = dns.RcodeNameError
	}
	_ = w.WriteMsg(m)
}
