"""Backend rates: how fast a backend prefills and decodes, measured, stored and kept fresh."""
