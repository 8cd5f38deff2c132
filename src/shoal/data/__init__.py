"""The model store ("data worker"): GGUF files served whole or by layer, and uploads.

``app.py`` runs it as its own process (HTTPS as the router serves it); ``routes.install``
embeds it into another FastAPI app. ``store.py`` is the folder, ``upload.py`` one upload
(resumable or one-shot), ``multipart.py`` the seed's form, ``keys.py`` who may read and upload
(flag keys and the key database, one rule for both ways of running it).
"""
