"""Test tooling that ships with the package: fuzzers shared by tests/ and bench/."""
