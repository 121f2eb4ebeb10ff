"""``epd up --ray``: the same cluster as ``epd up``, each process owned by a Ray actor.

    driver (epd up --ray)          Ray cluster (one or more nodes)
    ─────────────────────          ────────────────────────────────────────────────────────
    up.py: connect / start Ray     placement group SPREAD: one bundle per KV store node
    cluster.py: RayCluster ──────► ServiceActor per process (actor.py): spawns the very command
      (launcher.Cluster's             line ``epd up`` runs (python -m services.prefill ...), on its
       command lines, Ray actors      node's address; the process dies -> the actor exits -> Ray
       instead of children)           restarts it (max_restarts) on the same ports
    LocalScaler (--autoscale) ─────► more / fewer actors, registered with / drained by the router
                                      through its admin API, as for local processes

Nothing here is imported unless ``--ray`` is given; Ray itself is imported inside functions, so a
missing Ray is a clear error at ``epd up --ray`` and nowhere else.
"""
