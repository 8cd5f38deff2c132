"""What the router counts for ``/metrics``; the rooms above count into it.

* ``metrics.py``: ``Metrics``, the Prometheus counters and histograms, and the ``Snapshot``
  of gauges read at scrape time (``routes/snapshot.py`` builds it).
* ``gpu_metrics.py``: the ``shoal_gpu_*`` gauges, from each worker's latest heartbeat.
* ``autoscaling.py``: the scaling signals per model over the cluster (pure ``signals``),
  as ``shoal_cluster_*`` gauges and for ``GET /api/v1/autoscaling``.
"""
