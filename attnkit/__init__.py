"""attnkit: retrofit the attention of pretrained Hugging Face language models."""

__version__ = "0.1.0"
