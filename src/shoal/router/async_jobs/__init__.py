"""Async jobs (``/v1/jobs``): records, their stores (memory, Redis) and the service that runs
them in the background. The routes are in ``shoal.router.routes.jobs``."""
