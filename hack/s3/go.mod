// The S3-compatible object store the snapshot store tests run against
// (hack/s3/weed.sh builds it). Its own module so the project's go.mod does not
// carry SeaweedFS's dependencies.
module github.com/cubesandbox/cube/hack/s3

go 1.26.6

require github.com/seaweedfs/seaweedfs v0.0.0-20261109003541-7506e5f91cd6
