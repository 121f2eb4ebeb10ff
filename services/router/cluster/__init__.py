"""The instances behind the router: the backend seam, the pools and the gRPC pipeline."""
