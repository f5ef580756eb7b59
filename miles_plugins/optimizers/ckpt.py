"""The stable command path of the checkpoint tool::

    python -m miles_plugins.optimizers.ckpt inspect DIR
    python -m miles_plugins.optimizers.ckpt reshard DIR --dp N --out NEW_ITER_DIR

The command is :func:`miles_plugins.optimizers.checkpoint.cli.main`; this module
only runs it, so the path operators and scripts call stays valid.
"""

from miles_plugins.optimizers.checkpoint.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
