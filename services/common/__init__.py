"""Torch-free pieces every service shares: request types, config, errors."""
