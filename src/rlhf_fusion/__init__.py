"""rlhf-fusion: stage fusion plugins for existing RLHF trainers."""

__version__ = "0.1.0"
