"""The stable command path of the scratch purge that job epilogs run::

    python -m miles_plugins.optimizers.scratch purge DIR[,DIR...] [DIR ...]

The command is :func:`miles_plugins.optimizers.homes.scratch_purge.main`; this module
only runs it, so the path stays valid. No torch is imported.
"""

import sys

from miles_plugins.optimizers.homes.scratch_purge import main

if __name__ == "__main__":
    sys.exit(main())
