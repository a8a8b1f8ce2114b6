//go:build failpoints

package failpoint

// EnvHonoured reports whether LoadEnv enables what $CUBE_FAILPOINTS
// lists: only in binaries built with the failpoints tag (test builds).
const EnvHonoured = true
