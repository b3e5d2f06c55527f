"""Readers (and streaming writers) of what lies on disk: DCP, safetensors, torch.save."""
