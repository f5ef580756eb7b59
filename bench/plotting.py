"""The one matplotlib import the benches' ``--plot`` options share."""


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or exit saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
