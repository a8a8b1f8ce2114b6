// Package grpcerr is the one mapping between the project's errors
// (package errdefs) and gRPC status, in both directions, used at every gRPC
// edge: cubelet's API, cubemaster's, network-agent's, and their clients.
//
// A server returns ToGRPC(err); a client turns what comes back into the
// errdefs vocabulary with FromGRPC, so its callers classify a remote error
// exactly like an in-process one (errdefs.IsNotFound(err)).
//
//	errdefs kind               gRPC code
//	ErrOutOfRange              OutOfRange (it is an InvalidArgument too)
//	ErrInvalidArgument         InvalidArgument
//	ErrNotFound                NotFound
//	ErrAlreadyExists           AlreadyExists
//	ErrFailedPrecondition      FailedPrecondition
//	ErrNoSpace                 ResourceExhausted, detail Reason "NoSpace"
//	ErrResourceExhausted       ResourceExhausted
//	ErrUnavailable             Unavailable
//	ErrNotImplemented          Unimplemented
//	ErrAborted                 Aborted
//	ErrUnauthenticated         Unauthenticated
//	ErrPermissionDenied        PermissionDenied
//	context.DeadlineExceeded   DeadlineExceeded
//	context.Canceled           Canceled
//	ErrInternal                Internal
//	anything else              Internal (→ ErrInternal)
//	ErrInternal ←              Unknown, DataLoss (one way)
//
// The first row whose kind err wraps decides its code. Every kind comes
// back as itself (kind → code → kind), so the mapping is a bijection on
// the kinds; only Unknown and DataLoss, which the project never sends,
// fold into ErrInternal. A sub-kind with no code of its own (ErrNoSpace)
// travels as its parent's code with its name in the detail's Reason, and
// comes back as itself from a status that carries that detail.
//
// Every status ToGRPC makes carries an ErrorDetail (api/cubelet/v1, the one
// detail message the protos define): Reason is the code's name
// ("InvalidArgument") or a sub-kind's ("NoSpace"), Field the request field
// a *errdefs.FieldError names, and the sandbox ID and its state where the
// server adds them (ToGRPCDetail). FromGRPC keeps it: Detail(err) reads it on either side,
// and ToGRPC passes a remote error's detail on when a server relays it.
package grpcerr

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "github.com/cubesandbox/cube/api/cubelet/v1"
	"github.com/cubesandbox/cube/internal/errdefs"
)

// table is the mapping, in the order ToGRPC tries it.
var table = []struct {
	kind error
	code codes.Code
}{
	{errdefs.ErrOutOfRange, codes.OutOfRange}, // before InvalidArgument, which it also is
	{errdefs.ErrInvalidArgument, codes.InvalidArgument},
	{errdefs.ErrNotFound, codes.NotFound},
	{errdefs.ErrAlreadyExists, codes.AlreadyExists},
	{errdefs.ErrFailedPrecondition, codes.FailedPrecondition},
	{errdefs.ErrResourceExhausted, codes.ResourceExhausted},
	{errdefs.ErrUnavailable, codes.Unavailable},
	{errdefs.ErrNotImplemented, codes.Unimplemented},
	{errdefs.ErrAborted, codes.Aborted},
	{errdefs.ErrUnauthenticated, codes.Unauthenticated},
	{errdefs.ErrPermissionDenied, codes.PermissionDenied},
	{context.DeadlineExceeded, codes.DeadlineExceeded},
	{context.Canceled, codes.Canceled},
	{errdefs.ErrInternal, codes.Internal},
}

// subKinds are kinds that share their parent's code and are told apart by
// the ErrorDetail's Reason.
var subKinds = []struct {
	kind   error
	code   codes.Code
	reason string
}{
	{errdefs.ErrNoSpace, codes.ResourceExhausted, "NoSpace"},
}

// reason is the ErrorDetail Reason of err with code: a sub-kind's name, or
// the code's.
func reason(err error, code codes.Code) string {
	for _, sk := range subKinds {
		if sk.code == code && errors.Is(err, sk.kind) {
			return sk.reason
		}
	}
	return code.String()
}

// kindOf is Kind refined by a sub-kind's Reason.
func kindOf(c codes.Code, d *pb.ErrorDetail) error {
	for _, sk := range subKinds {
		if sk.code == c && d.GetReason() == sk.reason {
			return sk.kind
		}
	}
	return Kind(c)
}

// Code is the gRPC code of err: OK for nil, Internal for an error of no
// kind.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	for _, m := range table {
		if errors.Is(err, m.kind) {
			return m.code
		}
	}
	return codes.Internal
}

// Kind is the errdefs kind of a gRPC code: nil for OK, ErrInternal for
// Unknown, DataLoss and codes the table lacks.
func Kind(c codes.Code) error {
	if c == codes.OK {
		return nil
	}
	for _, m := range table {
		if m.code == c {
			return m.kind
		}
	}
	return errdefs.ErrInternal
}

// ToGRPC turns err into a status error with err's code (Code), its message
// and an ErrorDetail. An error that already is a status passes unchanged.
func ToGRPC(err error) error { return ToGRPCDetail(err, nil) }

// ToGRPCDetail is ToGRPC with the detail seeded by the server (the sandbox
// the call was about, its state); Reason and Field are always ToGRPC's.
// seed is not modified.
func ToGRPCDetail(err error, seed *pb.ErrorDetail) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	code := Code(err)
	d := &pb.ErrorDetail{}
	if prev := Detail(err); prev != nil {
		proto.Merge(d, prev)
	}
	if seed != nil {
		proto.Merge(d, seed)
	}
	d.Reason = reason(err, code)
	var fe *errdefs.FieldError
	if errors.As(err, &fe) {
		d.Field = fe.Field
	}
	st, derr := status.New(code, err.Error()).WithDetails(d)
	if derr != nil {
		return status.Error(code, err.Error())
	}
	return st.Err()
}

// FromGRPC turns a status error into one that wraps the code's errdefs
// kind (Kind), says the status message and keeps its ErrorDetail. nil and
// errors that are no status pass unchanged.
func FromGRPC(err error) error {
	if err == nil {
		return nil
	}
	st, ok := status.FromError(err)
	if !ok || st.Code() == codes.OK {
		return err
	}
	return &remoteError{code: st.Code(), msg: st.Message(), detail: statusDetail(st)}
}

// remoteError is what FromGRPC makes of a status.
type remoteError struct {
	code   codes.Code
	msg    string
	detail *pb.ErrorDetail
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return kindOf(e.code, e.detail) }

// Detail is the ErrorDetail of err, a status error or one FromGRPC made
// (wrapped or not), or nil.
func Detail(err error) *pb.ErrorDetail {
	if err == nil {
		return nil
	}
	var re *remoteError
	if errors.As(err, &re) {
		return re.detail
	}
	if st, ok := status.FromError(err); ok {
		return statusDetail(st)
	}
	return nil
}

func statusDetail(st *status.Status) *pb.ErrorDetail {
	for _, d := range st.Details() {
		if ed, ok := d.(*pb.ErrorDetail); ok {
			return ed
		}
	}
	return nil
}
