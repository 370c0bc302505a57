"""Network servers (HTTP and gRPC) over one shared serving runtime."""
