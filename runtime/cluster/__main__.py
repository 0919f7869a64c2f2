import sys

from ds4quant.runtime.cluster.launch import main

sys.exit(main())
