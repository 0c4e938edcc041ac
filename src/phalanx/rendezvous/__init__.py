"""The rendezvous layer (see DESIGN.md, Layers)."""
