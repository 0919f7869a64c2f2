"""GPU kernels of the runtime: the repacked weight layout (``layout``, torch
only) and the Triton MoE kernels (``moe_triton``, imports triton)."""
