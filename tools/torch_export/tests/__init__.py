"""Tests of the PyTorch exporter (`python3 -m unittest discover` from the repo root)."""
