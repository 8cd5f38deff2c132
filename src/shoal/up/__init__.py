"""``shoal up``: a router and a worker in one process, for one machine."""
