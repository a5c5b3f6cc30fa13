"""`python -m llmeasyquant.cli ...`: the form torchrun launches."""

import sys

from llmeasyquant.cli.main import main

sys.exit(main())
