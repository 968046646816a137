"""The offline recipes run as a user runs them."""
