"""Generated gRPC stubs (see codegen.py) and the import shortcuts the services use."""
