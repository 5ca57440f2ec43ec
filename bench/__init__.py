"""The rdmatensor micro-benchmark CLI."""
