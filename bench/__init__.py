"""Tether's benchmarks, in folders by what they measure; each script runs from the repository root as
`python -m bench.<folder>.<name>` (docs/benchmarks.md and docs/reliability.md quote every one). What several
share is in bench/common.py; what they share with the tests is in testing/: tests and bench never import each
other."""
