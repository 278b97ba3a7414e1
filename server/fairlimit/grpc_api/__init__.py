"""The gRPC adapter: the only package that imports grpc and the generated protobuf code."""
