"""The bundled runtime: decode-table registry, owners, placement, MoE execution."""
