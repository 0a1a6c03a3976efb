"""channelsmith: custom PyTorch builds for HPC networks, as a private conda channel."""

__version__ = "0.1.0"
