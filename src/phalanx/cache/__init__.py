"""The cache layer (see DESIGN.md, Layers)."""
