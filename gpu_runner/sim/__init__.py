"""The sim device: a timing model of an accelerator, no weights."""
