"""Leaf numerical ops shared by models and decoding (no imports from the rest of the package)."""
