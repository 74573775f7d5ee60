"""The trainer's launch: where this process's strategy comes from: its placement (or the workers it starts)
and a planned layout."""
