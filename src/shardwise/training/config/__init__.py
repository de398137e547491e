"""The training job file: its schema, the numbers derived from it, and loading it."""
