// Package nodeapi is cubemaster's gRPC edge: the NodeService cubelets
// register and heartbeat on, and the AdminService cubecli uses. Both are
// thin adapters over master.Service; errors become status codes here
// (grpcerr.ToGRPC).
//
// Where they are served:
//
//   - the unix socket (api.socket, mode 0600: root only) serves both;
//   - the TCP address (api.node) serves NodeService, and AdminService only
//     when api.admin_token is set, to callers presenting it; with [tls]
//     over mutual TLS, without only on a loopback address.
//
// When nodes.token is set, every NodeService call must carry it.
package nodeapi

import (
	"context"
	"crypto/subtle"
	"log/slog"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	masterpb "github.com/cubesandbox/cube/api/master/v1"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
	"github.com/cubesandbox/cube/internal/master"
	"github.com/cubesandbox/cube/internal/master/catalog"
	"github.com/cubesandbox/cube/internal/pki"
	"github.com/cubesandbox/cube/internal/serve"
)

// NodeServer implements masterpb.NodeServiceServer.
type NodeServer struct {
	masterpb.UnimplementedNodeServiceServer
	svc *master.Service
}

// Register implements NodeService.
func (n *NodeServer) Register(ctx context.Context, req *masterpb.RegisterRequest) (*masterpb.RegisterResponse, error) {
	if err := n.svc.Register(ctx, req.Node); err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.RegisterResponse{HeartbeatInterval: durationpb.New(n.svc.Config().Nodes.HeartbeatInterval.Duration)}, nil
}

// Heartbeat implements NodeService.
func (n *NodeServer) Heartbeat(ctx context.Context, req *masterpb.HeartbeatRequest) (*masterpb.HeartbeatResponse, error) {
	ok, err := n.svc.Heartbeat(ctx, req.Node)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.HeartbeatResponse{Registered: ok, HeartbeatInterval: durationpb.New(n.svc.Config().Nodes.HeartbeatInterval.Duration)}, nil
}

// blobChunk is the most ReadBlob returns per call, well under gRPC's
// 4 MiB message limit.
const blobChunk = 1 << 20

// ReadBlob implements NodeService: part of a template store blob.
func (n *NodeServer) ReadBlob(ctx context.Context, req *masterpb.ReadBlobRequest) (*masterpb.ReadBlobResponse, error) {
	buf := make([]byte, blobChunk)
	got, size, err := n.svc.ReadBlob(ctx, req.Digest, req.Offset, buf)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.ReadBlobResponse{Data: buf[:got], Size: size}, nil
}

// AdminServer implements masterpb.AdminServiceServer.
type AdminServer struct {
	masterpb.UnimplementedAdminServiceServer
	svc *master.Service
}

func ts(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func nodeToPB(v master.NodeView) *masterpb.Node {
	return &masterpb.Node{
		Report: v.Report, Healthy: v.Healthy, Reason: v.Reason, Schedulable: v.Schedulable,
		RegisteredAt: ts(v.RegisteredAt), LastHeartbeat: ts(v.LastHeartbeat), Sandboxes: int32(v.Sandboxes),
	}
}

// ListNodes implements AdminService.
func (a *AdminServer) ListNodes(ctx context.Context, _ *masterpb.ListNodesRequest) (*masterpb.ListNodesResponse, error) {
	views, err := a.svc.Nodes(ctx)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	out := &masterpb.ListNodesResponse{}
	for _, v := range views {
		out.Nodes = append(out.Nodes, nodeToPB(v))
	}
	return out, nil
}

// SetNodeSchedulable implements AdminService.
func (a *AdminServer) SetNodeSchedulable(ctx context.Context, req *masterpb.SetNodeSchedulableRequest) (*masterpb.SetNodeSchedulableResponse, error) {
	v, err := a.svc.SetSchedulable(ctx, req.NodeId, req.Schedulable)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.SetNodeSchedulableResponse{Node: nodeToPB(v)}, nil
}

// DrainNode implements AdminService: the drain runs while the stream is
// open, one message per step.
func (a *AdminServer) DrainNode(req *masterpb.DrainNodeRequest, stream masterpb.AdminService_DrainNodeServer) error {
	var sendErr error
	err := a.svc.Drain(stream.Context(), req.NodeId, master.DrainOptions{Wait: req.Wait, Parallel: int(req.Parallel),
		RequestWait: time.Duration(req.RequestWaitMs) * time.Millisecond}, func(ev master.DrainEvent) {
		if sendErr != nil {
			return
		}
		sendErr = stream.Send(&masterpb.DrainNodeProgress{
			NodeId: ev.NodeID, SandboxId: ev.SandboxID, State: ev.State, Phase: ev.Phase, ToNode: ev.To,
			Error: ev.Err, Took: durationpb.New(ev.Took), Remaining: int32(ev.Remaining), Total: int32(ev.Total),
		})
	})
	if err != nil {
		return grpcerr.ToGRPC(err)
	}
	return sendErr
}

// CreateJoinToken implements AdminService.
func (a *AdminServer) CreateJoinToken(ctx context.Context, req *masterpb.CreateJoinTokenRequest) (*masterpb.CreateJoinTokenResponse, error) {
	tok, exp, err := a.svc.CreateJoinToken(ctx, req.NodeId, req.Ttl.AsDuration())
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.CreateJoinTokenResponse{Token: tok, ExpiresAt: ts(exp)}, nil
}

func keyToPB(k *catalog.APIKey) *masterpb.APIKey {
	return &masterpb.APIKey{Id: k.ID, Name: k.Name, Prefix: k.Prefix, CreatedAt: ts(k.CreatedAt), LastUsedAt: ts(k.LastUsedAt), Admin: k.Admin, Team: k.Team}
}

// CreateAPIKey implements AdminService.
func (a *AdminServer) CreateAPIKey(ctx context.Context, req *masterpb.CreateAPIKeyRequest) (*masterpb.CreateAPIKeyResponse, error) {
	k, secret, err := a.svc.Keys().Create(ctx, req.Name, req.Team, req.Admin)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.CreateAPIKeyResponse{Key: keyToPB(k), Secret: secret}, nil
}

// ListAPIKeys implements AdminService.
func (a *AdminServer) ListAPIKeys(ctx context.Context, _ *masterpb.ListAPIKeysRequest) (*masterpb.ListAPIKeysResponse, error) {
	keys, err := a.svc.Keys().List(ctx)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	out := &masterpb.ListAPIKeysResponse{}
	for _, k := range keys {
		out.Keys = append(out.Keys, keyToPB(k))
	}
	return out, nil
}

// DeleteAPIKey implements AdminService.
func (a *AdminServer) DeleteAPIKey(ctx context.Context, req *masterpb.DeleteAPIKeyRequest) (*masterpb.DeleteAPIKeyResponse, error) {
	if _, err := a.svc.Keys().Delete(ctx, req.Key); err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.DeleteAPIKeyResponse{}, nil
}

func quotaFromPB(q *masterpb.TeamQuota) catalog.Quota {
	return catalog.Quota{MaxSandboxes: q.GetMaxSandboxes(), MaxMilliCPU: q.GetMaxMilliCpu(), MaxMemoryMiB: q.GetMaxMemoryMib()}
}

func teamToPB(t *catalog.Team, u catalog.TeamUsage) *masterpb.Team {
	return &masterpb.Team{
		Name: t.Name, CreatedAt: ts(t.CreatedAt),
		Quota:     &masterpb.TeamQuota{MaxSandboxes: t.Quota.MaxSandboxes, MaxMilliCpu: t.Quota.MaxMilliCPU, MaxMemoryMib: t.Quota.MaxMemoryMiB},
		Sandboxes: u.Sandboxes, MilliCpu: u.MilliCPU, MemoryMib: u.MemoryMiB,
	}
}

// CreateTeam implements AdminService.
func (a *AdminServer) CreateTeam(ctx context.Context, req *masterpb.CreateTeamRequest) (*masterpb.CreateTeamResponse, error) {
	t, err := a.svc.CreateTeam(ctx, req.Name, quotaFromPB(req.Quota))
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.CreateTeamResponse{Team: teamToPB(t, catalog.TeamUsage{})}, nil
}

// ListTeams implements AdminService.
func (a *AdminServer) ListTeams(ctx context.Context, _ *masterpb.ListTeamsRequest) (*masterpb.ListTeamsResponse, error) {
	teams, usage, err := a.svc.ListTeams(ctx)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	out := &masterpb.ListTeamsResponse{}
	for _, t := range teams {
		out.Teams = append(out.Teams, teamToPB(t, usage[t.Name]))
	}
	return out, nil
}

// SetTeamQuota implements AdminService.
func (a *AdminServer) SetTeamQuota(ctx context.Context, req *masterpb.SetTeamQuotaRequest) (*masterpb.SetTeamQuotaResponse, error) {
	if err := a.svc.SetTeamQuota(ctx, req.Name, quotaFromPB(req.Quota)); err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.SetTeamQuotaResponse{}, nil
}

// DeleteTeam implements AdminService.
func (a *AdminServer) DeleteTeam(ctx context.Context, req *masterpb.DeleteTeamRequest) (*masterpb.DeleteTeamResponse, error) {
	d, err := a.svc.DeleteTeam(ctx, req.Name, req.Force, caller(ctx))
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	out := &masterpb.DeleteTeamResponse{KilledSandboxes: d.Sandboxes, DeletedSnapshots: d.Snapshots}
	for _, k := range d.Keys {
		out.RevokedKeys = append(out.RevokedKeys, k.ID)
	}
	return out, nil
}

// caller names who made an admin call, for audit lines: the common name
// of its certificate over mutual TLS, else the root-only socket or the
// admin token.
func caller(ctx context.Context) string {
	if cert := serve.PeerCert(ctx); cert != nil {
		return "certificate " + cert.Subject.CommonName
	}
	return "admin socket or token"
}

// ListSandboxes implements AdminService.
func (a *AdminServer) ListSandboxes(ctx context.Context, req *masterpb.ListSandboxesRequest) (*masterpb.ListSandboxesResponse, error) {
	sbs, err := a.svc.ListAll(ctx, catalog.Query{States: req.States, Metadata: req.Metadata, NodeID: req.NodeId, Ascending: true})
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	out := &masterpb.ListSandboxesResponse{}
	for _, s := range sbs {
		out.Sandboxes = append(out.Sandboxes, &masterpb.Sandbox{
			SandboxId: s.ID, TemplateId: s.TemplateID, Alias: s.Alias, NodeId: s.NodeID, State: s.State,
			Metadata: s.Metadata, StartedAt: ts(s.StartedAt), EndAt: ts(s.EndAt),
			MilliCpu: s.MilliCPU, MemoryMib: s.MemoryMiB, AutoPause: s.AutoPause, AutoResume: s.AutoResume,
			IdleTimeout: idleTimeout(s.IdleTimeout), Runtime: s.Runtime, Team: s.Team,
		})
	}
	return out, nil
}

func templateToPB(t master.Template) *masterpb.ClusterTemplate {
	return &masterpb.ClusterTemplate{TemplateId: t.ID, Digest: t.Digest, SizeBytes: t.SizeBytes, Nodes: t.Nodes, CreatedAt: ts(t.CreatedAt),
		Runtimes: t.Runtimes, WarmNodes: t.WarmNodes, Stored: t.Stored}
}

// ListTemplates implements AdminService.
func (a *AdminServer) ListTemplates(context.Context, *masterpb.ListTemplatesRequest) (*masterpb.ListTemplatesResponse, error) {
	out := &masterpb.ListTemplatesResponse{}
	for _, t := range a.svc.Templates() {
		out.Templates = append(out.Templates, templateToPB(t))
	}
	return out, nil
}

// ImportTemplate implements AdminService.
func (a *AdminServer) ImportTemplate(ctx context.Context, req *masterpb.ImportTemplateRequest) (*masterpb.ImportTemplateResponse, error) {
	t, err := a.svc.ImportTemplate(ctx, master.TemplateImport{
		ID: req.TemplateId, Source: req.Source, NodeID: req.NodeId, Runtime: req.Runtime, Warm: req.Warm,
		ImageRef: req.ImageRef, Insecure: req.Insecure, SourceOnNodes: req.SourceOnNodes,
		Username: req.GetAuth().GetUsername(), Password: req.GetAuth().GetPassword(), Token: req.GetAuth().GetToken(),
	})
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.ImportTemplateResponse{Template: templateToPB(t)}, nil
}

// UploadTemplate implements AdminService: the request, then the archive.
func (a *AdminServer) UploadTemplate(stream grpc.ClientStreamingServer[masterpb.UploadTemplateRequest, masterpb.ImportTemplateResponse]) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	req := first.GetRequest()
	if req == nil {
		return status.Error(codes.InvalidArgument, "the first message of an upload must be the request")
	}
	t, err := a.svc.ImportUpload(stream.Context(), master.TemplateImport{
		ID: req.TemplateId, NodeID: req.NodeId, Runtime: req.Runtime, Warm: req.Warm,
		Source: req.Source, ImageRef: req.ImageRef, SourceOnNodes: req.SourceOnNodes,
	}, &uploadReader{stream: stream})
	if err != nil {
		return grpcerr.ToGRPC(err)
	}
	return stream.SendAndClose(&masterpb.ImportTemplateResponse{Template: templateToPB(t)})
}

// uploadReader reads an upload's chunks as one stream of bytes.
type uploadReader struct {
	stream grpc.ClientStreamingServer[masterpb.UploadTemplateRequest, masterpb.ImportTemplateResponse]
	buf    []byte
}

func (u *uploadReader) Read(p []byte) (int, error) {
	for len(u.buf) == 0 {
		m, err := u.stream.Recv()
		if err != nil {
			return 0, err // io.EOF at the end of the upload
		}
		if m.GetRequest() != nil {
			return 0, status.Error(codes.InvalidArgument, "an upload has one request, first")
		}
		u.buf = m.GetChunk()
	}
	n := copy(p, u.buf)
	u.buf = u.buf[n:]
	return n, nil
}

// DeleteTemplate implements AdminService.
func (a *AdminServer) DeleteTemplate(ctx context.Context, req *masterpb.DeleteTemplateRequest) (*masterpb.DeleteTemplateResponse, error) {
	nodes, err := a.svc.DeleteTemplate(ctx, req.TemplateId)
	if err != nil {
		return nil, grpcerr.ToGRPC(err)
	}
	return &masterpb.DeleteTemplateResponse{Nodes: nodes}, nil
}

func tokenOK(ctx context.Context, header, want string) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get(header) {
		if subtle.ConstantTimeCompare([]byte(v), []byte(want)) == 1 {
			return true
		}
	}
	return false
}

// guard checks the node token on NodeService calls and, when adminToken
// is set, the admin token on AdminService calls. A call over mutual TLS
// ([tls]) must also come from a certificate of the right role, and a
// node's report must be about the node its certificate names.
func guard(nodeToken, adminToken string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		switch {
		case strings.HasPrefix(info.FullMethod, "/master.v1.NodeService/"):
			if nodeToken != "" && !tokenOK(ctx, masterpb.NodeTokenHeader, nodeToken) {
				return nil, status.Error(codes.Unauthenticated, "missing or wrong node token (master nodes.token)")
			}
			if err := nodeIdentity(ctx, req); err != nil {
				return nil, err
			}
		case strings.HasPrefix(info.FullMethod, "/master.v1.AdminService/"), strings.HasPrefix(info.FullMethod, "/master.v1.RouteService/"):
			if adminToken != "" && !tokenOK(ctx, masterpb.AdminTokenHeader, adminToken) {
				return nil, status.Error(codes.Unauthenticated, "missing or wrong admin token")
			}
			if err := adminIdentity(ctx, info.FullMethod); err != nil {
				return nil, err
			}
		}
		return h(ctx, req)
	}
}

// nodeIdentity binds a node's reports to its certificate: over mutual TLS
// a Register, Heartbeat or ReadBlob must come from a node certificate whose common
// name is the reported node ID, so a holder of one node's certificate
// cannot register as, or report for, another. Calls without a peer
// certificate (the root-only socket) are not checked here.
func nodeIdentity(ctx context.Context, req any) error {
	cert := serve.PeerCert(ctx)
	if cert == nil {
		return nil
	}
	var id string
	switch r := req.(type) {
	case *masterpb.RegisterRequest:
		id = r.GetNode().GetNodeId()
	case *masterpb.HeartbeatRequest:
		id = r.GetNode().GetNodeId()
	case *masterpb.ReadBlobRequest:
		// Templates are the cluster's, not one node's: any node may read
		// any blob, but only as itself, and a proxy or admin certificate
		// may not.
		id = r.GetNodeId()
	default:
		return nil
	}
	if !slices.Contains(cert.Subject.OrganizationalUnit, string(pki.RoleNode)) || cert.Subject.CommonName != id {
		return status.Errorf(codes.PermissionDenied, "node %q: the caller's certificate is %q (role %v), not this node's", id, cert.Subject.CommonName, cert.Subject.OrganizationalUnit)
	}
	return nil
}

// adminIdentity: over mutual TLS, AdminService needs an admin certificate
// and RouteService an admin or proxy one (a node's certificate is not
// enough to act on the cluster).
func adminIdentity(ctx context.Context, method string) error {
	cert := serve.PeerCert(ctx)
	if cert == nil {
		return nil
	}
	ou := cert.Subject.OrganizationalUnit
	if slices.Contains(ou, string(pki.RoleAdmin)) ||
		strings.HasPrefix(method, "/master.v1.RouteService/") && slices.Contains(ou, string(pki.RoleProxy)) {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "%s: the caller's certificate %q has role %v", method, cert.Subject.CommonName, ou)
}

// Listen opens the socket and TCP listeners (a refusal, such as api.node
// beyond loopback without [tls], is an error here); the group's Run
// serves them.
func Listen(svc *master.Service, log *slog.Logger) (*serve.Group, error) {
	cfg := svc.Config()
	g := &serve.Group{Log: log, Grace: 5 * time.Second}
	if p := cfg.API.Socket; p != "" {
		l, err := g.Unix(p)
		if err != nil {
			return nil, err
		}
		gs := serve.NewGRPCServer(grpc.UnaryInterceptor(guard(cfg.Nodes.Token, "")))
		masterpb.RegisterNodeServiceServer(gs, &NodeServer{svc: svc})
		masterpb.RegisterAdminServiceServer(gs, &AdminServer{svc: svc})
		masterpb.RegisterRouteServiceServer(gs, &RouteServer{svc: svc})
		g.GRPC("cubemaster node API", gs, l)
	}
	if a := cfg.API.Node; a != "" {
		mtls, err := cfg.TLS.MutualServer("tls")
		if err != nil {
			g.Close()
			return nil, err
		}
		l, err := g.TCP("api.node", "[tls] cert, key and ca", a, mtls)
		if err != nil {
			g.Close()
			return nil, err
		}
		gs := serve.NewGRPCServer(grpc.UnaryInterceptor(guard(cfg.Nodes.Token, cfg.API.AdminToken)),
			grpc.StreamInterceptor(streamGuard(cfg.API.AdminToken)))
		masterpb.RegisterNodeServiceServer(gs, &NodeServer{svc: svc})
		if cfg.API.AdminToken != "" {
			masterpb.RegisterAdminServiceServer(gs, &AdminServer{svc: svc})
			masterpb.RegisterRouteServiceServer(gs, &RouteServer{svc: svc})
		}
		g.GRPC("cubemaster node API", gs, l)
	}
	return g, nil
}

func idleTimeout(d time.Duration) *durationpb.Duration {
	if d <= 0 {
		return nil
	}
	return durationpb.New(d)
}
