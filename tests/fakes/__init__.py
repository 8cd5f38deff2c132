"""FAKE stand-ins for outside services that tests cannot reach (see each module's docstring)."""
