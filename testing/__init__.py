"""What the tests and the benchmarks both build on; tests and bench import this package, never each other.

tiny_models, tiny_families, tiny_gguf, tiny_hybrid, tiny_vision   tiny random-weight models of every family
family_tokenizers, data/                                           their tokenizers and chat templates
faulty_replica                                                     the drills' replica whose engine breaks on cue
local_depot                                                        a StateDepot called in-process like a handle
migration, routing_warmup                                          the scenarios across a change of replicas
fuzz_hooks                                                         the OpenAI error-shape check, the fuzz caps
gpu_timings                                                        the GPU check's inputs, timings and table
"""
