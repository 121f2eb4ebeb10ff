"""vLLM as the engine of a prefill or decode instance (``--engine vllm``).

Runs in vLLM's own venv (``make setup-vllm``: ``.venv-vllm``), which holds vLLM and epd; the
router and the rest of the cluster do not import it. See :mod:`.backend` for how a request
goes through, :mod:`.connector` for the KV connector inside vLLM's processes.
"""
