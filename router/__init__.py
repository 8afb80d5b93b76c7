"""Router: the public gRPC front door (Generate), instance choice, and the `pdserve` CLI."""
