package grpcerr_test

import (
	"context"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
	"github.com/cubesandbox/cube/internal/errdefs/grpcerr"
)

// kinds is every errdefs kind, by the name it has in package errdefs,
// with its code.
var kinds = []struct {
	name string
	kind error
	code codes.Code
}{
	{"ErrInvalidArgument", errdefs.ErrInvalidArgument, codes.InvalidArgument},
	{"ErrOutOfRange", errdefs.ErrOutOfRange, codes.OutOfRange},
	{"ErrNotFound", errdefs.ErrNotFound, codes.NotFound},
	{"ErrAlreadyExists", errdefs.ErrAlreadyExists, codes.AlreadyExists},
	{"ErrFailedPrecondition", errdefs.ErrFailedPrecondition, codes.FailedPrecondition},
	{"ErrResourceExhausted", errdefs.ErrResourceExhausted, codes.ResourceExhausted},
	{"ErrUnavailable", errdefs.ErrUnavailable, codes.Unavailable},
	{"ErrNotImplemented", errdefs.ErrNotImplemented, codes.Unimplemented},
	{"ErrInternal", errdefs.ErrInternal, codes.Internal},
	{"ErrAborted", errdefs.ErrAborted, codes.Aborted},
	{"ErrUnauthenticated", errdefs.ErrUnauthenticated, codes.Unauthenticated},
	{"ErrPermissionDenied", errdefs.ErrPermissionDenied, codes.PermissionDenied},
	{"context.DeadlineExceeded", context.DeadlineExceeded, codes.DeadlineExceeded},
	{"context.Canceled", context.Canceled, codes.Canceled},
}

// subKinds share their parent's code and travel by the detail's Reason.
var subKinds = []struct {
	name   string
	kind   error
	parent error
	code   codes.Code
	reason string
}{
	{"ErrNoSpace", errdefs.ErrNoSpace, errdefs.ErrResourceExhausted, codes.ResourceExhausted, "NoSpace"},
}

// TestEveryKindIsListed fails when errdefs gains a kind this test (and so,
// likely, the mapping) does not know.
func TestEveryKindIsListed(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "../errdefs.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, k := range kinds {
		listed[k.name] = true
	}
	for _, k := range subKinds {
		listed[k.name] = true
	}
	n := 0
	for _, decl := range f.Decls {
		g, ok := decl.(*ast.GenDecl)
		if !ok || g.Tok != token.VAR {
			continue
		}
		for _, s := range g.Specs {
			for _, id := range s.(*ast.ValueSpec).Names {
				if !strings.HasPrefix(id.Name, "Err") {
					continue
				}
				n++
				if !listed[id.Name] {
					t.Errorf("errdefs.%s is not in this test's table (nor perhaps in grpcerr's)", id.Name)
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("found no Err* variables in errdefs.go")
	}
}

// TestRoundTrip: kind → status → kind, with the message and the detail.
func TestRoundTrip(t *testing.T) {
	codesSeen := map[codes.Code]string{}
	for _, k := range kinds {
		t.Run(k.name, func(t *testing.T) {
			if prev, ok := codesSeen[k.code]; ok {
				t.Fatalf("%s and %s share %s", prev, k.name, k.code)
			}
			codesSeen[k.code] = k.name
			if got := grpcerr.Kind(k.code); got != k.kind {
				t.Fatalf("Kind(%s) = %v, want %v", k.code, got, k.kind)
			}
			orig := fmt.Errorf("sandbox sb1: %w", k.kind)
			sent := grpcerr.ToGRPCDetail(orig, &pb.ErrorDetail{SandboxId: "sb1",
				CurrentState: pb.SandboxState_SANDBOX_STATE_PAUSED})
			st, ok := status.FromError(sent)
			if !ok || st.Code() != k.code || st.Message() != orig.Error() {
				t.Fatalf("ToGRPC: %v (%v), want %s %q", st.Code(), st.Message(), k.code, orig)
			}
			want := &pb.ErrorDetail{Reason: k.code.String(), SandboxId: "sb1",
				CurrentState: pb.SandboxState_SANDBOX_STATE_PAUSED}
			if d := grpcerr.Detail(sent); !proto.Equal(d, want) {
				t.Fatalf("status detail %v, want %v", d, want)
			}

			got := grpcerr.FromGRPC(sent)
			if !errors.Is(got, k.kind) {
				t.Fatalf("FromGRPC: %v is not %v", got, k.kind)
			}
			if got.Error() != orig.Error() {
				t.Fatalf("message %q, want %q", got, orig)
			}
			if d := grpcerr.Detail(got); !proto.Equal(d, want) {
				t.Fatalf("detail after FromGRPC %v, want %v", d, want)
			}
			if c := grpcerr.Code(got); c != k.code {
				t.Fatalf("Code(FromGRPC) = %s, want %s", c, k.code)
			}
			for _, other := range kinds {
				if other.kind != k.kind && errors.Is(got, other.kind) &&
					!(k.kind == errdefs.ErrOutOfRange && other.kind == errdefs.ErrInvalidArgument) {
					t.Fatalf("%v is also %v", got, other.kind)
				}
			}

			// Relayed by a second server (the master passing on a cubelet's
			// error): same code and detail, the relay's message.
			relayed := grpcerr.ToGRPC(fmt.Errorf("node n1: %w", got))
			st, _ = status.FromError(relayed)
			if st.Code() != k.code || st.Message() != "node n1: "+orig.Error() {
				t.Fatalf("relayed: %s %q", st.Code(), st.Message())
			}
			if d := grpcerr.Detail(relayed); !proto.Equal(d, want) {
				t.Fatalf("relayed detail %v, want %v", d, want)
			}
		})
	}
}

// TestSubKindRoundTrip: a sub-kind → its parent's code with its Reason →
// the sub-kind again, also when relayed; a status of the parent's code
// without that Reason (another server's) is the parent only.
func TestSubKindRoundTrip(t *testing.T) {
	for _, k := range subKinds {
		t.Run(k.name, func(t *testing.T) {
			if !errors.Is(k.kind, k.parent) {
				t.Fatalf("%v is not %v", k.kind, k.parent)
			}
			orig := fmt.Errorf("clone: filesystem /var/lib/cube is full: %w", k.kind)
			sent := grpcerr.ToGRPC(orig)
			st, _ := status.FromError(sent)
			if st.Code() != k.code || st.Message() != orig.Error() {
				t.Fatalf("ToGRPC: %s %q", st.Code(), st.Message())
			}
			if d := grpcerr.Detail(sent); d.GetReason() != k.reason {
				t.Fatalf("reason %q, want %q", d.GetReason(), k.reason)
			}
			got := grpcerr.FromGRPC(sent)
			if !errors.Is(got, k.kind) || !errors.Is(got, k.parent) || got.Error() != orig.Error() {
				t.Fatalf("FromGRPC: %v (is %v: %t)", got, k.kind, errors.Is(got, k.kind))
			}
			relayed := grpcerr.FromGRPC(grpcerr.ToGRPC(fmt.Errorf("node n1: %w", got)))
			if !errors.Is(relayed, k.kind) {
				t.Fatalf("relayed: %v is not %v", relayed, k.kind)
			}
			// Control: the parent alone does not become the sub-kind.
			plain := grpcerr.FromGRPC(grpcerr.ToGRPC(fmt.Errorf("busy: %w", k.parent)))
			if errors.Is(plain, k.kind) || !errors.Is(plain, k.parent) {
				t.Fatalf("parent round trip: %v (is sub-kind: %t)", plain, errors.Is(plain, k.kind))
			}
			if bare := grpcerr.FromGRPC(status.Error(k.code, "x")); errors.Is(bare, k.kind) {
				t.Fatal("a status without the detail became the sub-kind")
			}
		})
	}
}

func TestFieldError(t *testing.T) {
	orig := fmt.Errorf("create: %w", errdefs.FieldErrorf("env", "invalid name %q", "1X"))
	got := grpcerr.FromGRPC(grpcerr.ToGRPC(orig))
	if !errdefs.IsInvalidArgument(got) || got.Error() != orig.Error() {
		t.Fatalf("got %v", got)
	}
	if d := grpcerr.Detail(got); d == nil || d.Field != "env" || d.Reason != "InvalidArgument" {
		t.Fatalf("detail %v", d)
	}
	// The field of the error wins over a relayed detail's.
	relayed := grpcerr.ToGRPC(&errdefs.FieldError{Field: "template", Msg: got.Error()})
	if d := grpcerr.Detail(relayed); d == nil || d.Field != "template" {
		t.Fatalf("relayed detail %v", d)
	}
}

func TestEdges(t *testing.T) {
	if grpcerr.ToGRPC(nil) != nil || grpcerr.FromGRPC(nil) != nil || grpcerr.Detail(nil) != nil {
		t.Fatal("nil must stay nil")
	}
	if grpcerr.Code(nil) != codes.OK || grpcerr.Kind(codes.OK) != nil {
		t.Fatal("OK is no error")
	}
	// No kind: Internal, and back as ErrInternal.
	plain := errors.New("disk on fire")
	if c := grpcerr.Code(plain); c != codes.Internal {
		t.Fatalf("plain error: %s", c)
	}
	if got := grpcerr.FromGRPC(grpcerr.ToGRPC(plain)); !errdefs.IsInternal(got) || got.Error() != plain.Error() {
		t.Fatalf("plain round trip: %v", got)
	}
	// Codes the project never sends fold into ErrInternal.
	for _, c := range []codes.Code{codes.Unknown, codes.DataLoss} {
		if got := grpcerr.FromGRPC(status.Error(c, "x")); !errdefs.IsInternal(got) {
			t.Fatalf("%s: %v", c, got)
		}
	}
	// A status passes ToGRPC unchanged; a non-status passes FromGRPC unchanged.
	st := status.Error(codes.Unauthenticated, "no token")
	if grpcerr.ToGRPC(st) != st {
		t.Fatal("ToGRPC changed a status")
	}
	if grpcerr.FromGRPC(plain) != plain {
		t.Fatal("FromGRPC changed a plain error")
	}
	// FromGRPC is idempotent.
	once := grpcerr.FromGRPC(st)
	if grpcerr.FromGRPC(once) != once || !errdefs.IsUnauthenticated(once) {
		t.Fatalf("FromGRPC twice: %v", once)
	}
	// A status without a detail (another server's): no detail, still a kind.
	if got := grpcerr.FromGRPC(st); grpcerr.Detail(got) != nil {
		t.Fatal("detail out of nothing")
	}
	// The first kind in the table decides.
	both := fmt.Errorf("%w: %w", errdefs.ErrNotFound, context.Canceled)
	if c := grpcerr.Code(both); c != codes.NotFound {
		t.Fatalf("NotFound and Canceled: %s", c)
	}
}
