"""See design.md."""
