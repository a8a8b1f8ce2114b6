//go:build tools

// Package s3 pins the SeaweedFS version whose weed binary the store tests run.
package s3

import _ "github.com/seaweedfs/seaweedfs/weed"
