"""The update engine: how a param group's state is stored (codecs) and the one driver that
steps it through torch's fused Adam/AdamW kernel."""
