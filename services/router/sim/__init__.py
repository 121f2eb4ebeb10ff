"""The cluster simulator: the live router's placement core and policies over simulated prefill
and decode instances.

    python -m services.router.sim --help

Modules by concern: ``trace`` (the Mooncake trace), ``work`` (costs, offered load), ``bound``
(the balanced bound every policy is held against), ``instances`` (simulated prefill and decode
instances and their load reports), ``cluster`` (the event loop around the router's
``policies/placer.py``), ``experiment`` (one scaled trace, many policies), ``report`` and
``plot`` (figures).
"""
