"""tcp: the one-sided contract emulated over a TCP stream, each payload received straight into its slot."""
