"""Codebook fitting, validation, and the out-of-band tables' wire formats."""
