"""What the test folders share: the rank runner (ranks.py) and the provider
list every contract test is parametrized over (providers.py)."""
