"""Built-in model families; importing this registers their train specs."""

from components.models import llama  # noqa: F401  (registers "llama")
