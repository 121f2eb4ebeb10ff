"""The cluster simulator: the live router's placement core and policies over simulated prefill
and decode instances.

    python -m services.router.sim --help

Modules by concern: ``trace`` (the Mooncake trace, and phased traces built from it), ``work``
(costs, offered load), ``bound`` (the balanced bound every policy is held against), ``instances``
(simulated prefill and decode instances and their load reports), ``cluster`` (the event loop
around the router's ``policies/placer.py``, and membership), ``scaling`` (the planner's own core
scaling the cluster, instance-seconds), ``experiment`` (one scaled trace, many policies),
``report`` and ``plot`` (figures).
"""
