"""The engine layer (see DESIGN.md, Layers)."""

__all__: list[str] = []
