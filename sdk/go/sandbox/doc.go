// Package sandbox is a Go client for CubeSandbox and other E2B-compatible
// services: it creates, lists, pauses, resumes, snapshots, forks and kills
// sandboxes through the E2B REST API, and runs commands (streamed output,
// stdin, PTYs) and moves files (read, write, list, watch) inside them
// through the sandbox agent's envd Connect API, with the generated clients
// of the very protos the agent serves (api/envd in the CubeSandbox
// repository).
//
// Configuration follows E2B's SDKs: an API key (E2B_API_KEY), a domain
// (E2B_DOMAIN, from which the API URL https://api.<domain> and sandbox URLs
// https://<port>-<sandboxID>.<domain> follow), or explicit URLs
// (E2B_API_URL, and E2B_SANDBOX_URL for a single route that takes the
// sandbox and port in headers). Fields set in Config win over the
// environment.
//
// Every call takes a context.Context. Errors match the sentinels of this
// package with errors.Is (ErrNotFound, ErrAuth, ErrRateLimit, ErrTimeout,
// ...), and carry the server's status and message in *APIError (REST) or
// the Connect error (envd). A command that exits non-zero returns its
// result together with a *CommandExitError.
package sandbox
