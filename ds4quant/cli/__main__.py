"""``python -m ds4quant.cli``: the same as the ``ds4quant`` command."""

import sys

from ds4quant.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
