"""The comm layer (see DESIGN.md, Layers)."""
