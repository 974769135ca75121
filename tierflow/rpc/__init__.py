"""Generated gRPC stubs for proto/tierflow/rpc/tier.proto. Never edit them by hand."""
