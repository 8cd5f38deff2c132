"""Where jobs wait for a worker. In-process by default."""
