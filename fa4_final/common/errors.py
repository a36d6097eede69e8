"""The package's own exception: a setup fa4_final does not run, said plainly."""


class UnsupportedError(ValueError):
    """A setup this package does not run (a GPU, a CPU tensor, an arch, a feature), with what
    it does run. A ValueError, so code that catches bad input catches it too."""
