"""The trainer's checkpointing: a run's directory, what a checkpoint holds, and taking one back."""
