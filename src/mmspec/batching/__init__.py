"""The batched engine: one step over every request's row, its state on the device."""
