"""Conversions between DCP checkpoints, Hugging Face safetensors folders and ``torch.save``
files, streaming (one tensor, or one block of rows, at a time), and ``adapters/``: one model
family per file, its key map as data."""
