"""The model store ("data worker"): GGUF files served whole or by layer, and uploads.

``app.py`` runs it as its own process; ``routes.install`` embeds it into another FastAPI app.
"""
