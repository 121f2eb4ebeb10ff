"""The router: the cluster's HTTP front door (OpenAI-compatible API) and its request pipeline.

Torch-free by rule: it imports only ``services.common`` and ``kvstore``.
"""
