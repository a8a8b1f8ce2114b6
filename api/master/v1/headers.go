package masterv1

// Metadata keys of the master's gRPC APIs (hand-written, next to the
// generated code, so cubelet and cubemaster share them).
const (
	// NodeTokenHeader carries a cubelet's master.token on NodeService calls.
	NodeTokenHeader = "x-cube-node-token"
	// AdminTokenHeader carries the admin token on AdminService calls over TCP.
	AdminTokenHeader = "x-cube-admin-token"
)
