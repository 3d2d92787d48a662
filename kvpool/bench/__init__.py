"""Benchmarks behind ``kvpool bench``: each measures its baseline in the same run."""
