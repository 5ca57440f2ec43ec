"""Data providers: one way each to do a one-sided write into a peer's registered memory."""
