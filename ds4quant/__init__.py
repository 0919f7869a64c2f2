"""ds4quant: DeepSeek-V4 MoE checkpoints to ROCmFPX expert artifacts.

Kept light on purpose: importing ``ds4quant`` or ``ds4quant.formats`` must not
import torch or transformers.
"""

from ds4quant.version import VERSION as __version__

from ds4quant.errors import Ds4quantError  # noqa: E402

__all__ = ["__version__", "Ds4quantError"]
