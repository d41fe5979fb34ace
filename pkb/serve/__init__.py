"""``pkb serve``: pkb as a long-running evaluation service over HTTP + JSON (docs/serve.md)."""
