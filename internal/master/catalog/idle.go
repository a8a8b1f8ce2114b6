package catalog

import "context"

// WithIdleTimeout returns the running sandboxes that have an idle policy
// (the master's idle loop checks each against the traffic it has seen).
// Metadata is not loaded.
func (c *Catalog) WithIdleTimeout(ctx context.Context) ([]*Sandbox, error) {
	return c.querySandboxes(ctx, `SELECT `+sandboxCols+` FROM sandboxes WHERE state = ? AND idle_timeout_ms > 0`, StateRunning)
}
