"""Units of work for one delivery and for a batch, and the contexts handlers receive."""
