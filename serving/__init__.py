"""gRPC prediction server for exported recship artifacts."""
