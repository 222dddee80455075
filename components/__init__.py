"""Builders the trainer plugs together; importing this registers the built-in "llama" spec."""

from components import llama  # noqa: F401  (registers the built-in train spec)
