"""``python -m tinyvllm`` runs the command line (see ``tinyvllm.cli``)."""

import sys

from tinyvllm.cli import main

sys.exit(main())
