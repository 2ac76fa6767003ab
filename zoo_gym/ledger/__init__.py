"""zoo-gym."""
