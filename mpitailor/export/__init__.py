"""Outputs beyond the native ZeRO-3 checkpoint: consolidated HF weights, Universal layout."""
