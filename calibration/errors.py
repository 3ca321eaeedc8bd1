"""Calibration errors (kept light: the CLI imports them before anything heavy)."""


class CalibrationError(ValueError):
    """Calibration input that cannot give a meaningful gradient; the message names the source."""


class SplitError(ValueError):
    """A split that cannot be made; the message says which sources or parameters."""
