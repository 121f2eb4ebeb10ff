"""The public API: each protocol's bodies, checks and formats, and the shared generation core."""
