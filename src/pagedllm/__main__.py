"""``python -m pagedllm ...``: the same command line as ``pagedllm``."""

import sys

from pagedllm.cli import main

sys.exit(main())
