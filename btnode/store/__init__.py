"""Checkpoints: generic atomic safetensors+JSON files (files.py) and model-aware save/load (models.py)."""
