"""Structure-aware fuzzing of the project's servers (see tests/test_fuzz.py and ``make fuzz``)."""
