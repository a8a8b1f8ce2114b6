//go:build !failpoints

package failpoint

// EnvHonoured reports whether LoadEnv enables what $CUBE_FAILPOINTS
// lists: only in binaries built with the failpoints tag (test builds).
// Release builds (make build, hack/up.sh, what cube up runs) are built
// without it: whoever may set a daemon's environment must not be able
// to make it fail, hang or kill itself at will.
const EnvHonoured = false
