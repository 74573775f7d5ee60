"""The trainer's configuration: the config: its file and sections, the trainer's options, the targets it
names, the default callbacks."""
