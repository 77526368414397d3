"""`python -m bridge ...`: see bridge/cli.py."""

import sys

from bridge import _layers

_layers.check_not_shadowed("python -m bridge")

from bridge.cli import main  # noqa: E402

sys.exit(main())
