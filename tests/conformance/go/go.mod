module github.com/rollout-checkpoint/rollout-checkpoint/tests/conformance/go

go 1.26.0

require (
	github.com/rollout-checkpoint/rollout-checkpoint/gen/go v1.0.0
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
)

require (
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20261110000943-09e21b237f2c // indirect
)

// The module of this repository's gen/go, as a user gets it with
// `go get github.com/rollout-checkpoint/rollout-checkpoint/gen/go@latest`; here the working
// tree's copy, so the controller always tests the package as committed.
replace github.com/rollout-checkpoint/rollout-checkpoint/gen/go => ../../../gen/go
