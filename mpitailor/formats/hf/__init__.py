"""Hugging Face files: safetensors headers and files, and the config and tokenizer files an
export carries."""
