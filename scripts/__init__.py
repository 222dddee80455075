"""Command-line tools: `python -m scripts.convert` (checkpoint layouts)."""
