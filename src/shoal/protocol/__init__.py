"""Wire types every side imports. Imports nothing else from Shoal."""
