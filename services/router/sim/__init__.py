"""The cluster simulator: the live router's policies over simulated prefill and decode instances.

    python -m services.router.sim --help

Modules by concern: ``trace`` (the Mooncake trace), ``work`` (costs, offered load, the balanced
bound), ``instances`` (simulated prefill and decode instances), ``cluster`` (the event loop and
routing), ``experiment`` (one scaled trace, many policies), ``report`` and ``plot`` (figures).
"""
