module github.com/cubesandbox/cube/sdk/go

go 1.26.8

require (
	connectrpc.com/connect v1.21.1
	github.com/cubesandbox/cube v0.0.0-00010101000000-000000000000
)

require google.golang.org/protobuf v1.36.13-0.20261016172727-e9ee2a76ab8e // indirect

// The envd Connect clients are generated in the repository's root module
// (api/envd), from the protos the sandbox agent serves.
replace github.com/cubesandbox/cube => ../..
