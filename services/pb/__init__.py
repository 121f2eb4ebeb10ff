"""Generated gRPC stubs (see generate.py); never edit by hand."""
