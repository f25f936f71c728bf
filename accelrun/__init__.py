"""accelrun: declarative training acceleration for PyTorch."""

__version__ = "0.1.0"
