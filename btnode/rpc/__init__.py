"""The only package that imports grpc or the generated protobuf code (btnode.v2)."""
