"""Training side: helpers used inside a DeepSpeed training run."""
