"""The reference trainer (``python -m dcpkit.train``)."""
