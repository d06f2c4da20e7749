"""The package version (a leaf: any layer may import it)."""
__version__ = "0.1.0"
