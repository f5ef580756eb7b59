"""Plugins for miles; ``miles_plugins.optimizers`` streams optimizer state."""
