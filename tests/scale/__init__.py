"""Load and scale measurements of the control plane (issue 34), test code named as such: ``python -m
tests.scale.<module>``."""
