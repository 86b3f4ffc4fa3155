"""What the tests and the benchmarks both build on: tiny random-weight models of every family, their
tokenizers and chat templates, the faulty replica of the drills, the in-process state depot, the migration
scenarios and the OpenAI error-shape check. Tests and bench import this package, never each other."""
