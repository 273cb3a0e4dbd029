"""The scheduler process and everything shared by all gapless processes."""
