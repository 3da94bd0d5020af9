"""How a delivery ends: the single and batch pipelines, acknowledgment modes, backout."""
