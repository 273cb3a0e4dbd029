"""What every gapless process shares: config, wire messages, channels, metrics definitions,
model files. Nothing here imports a role's module."""
