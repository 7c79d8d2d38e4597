"""Fuzzing RapidMoE's inputs: structure-aware mutators (GGUF models and sidecars, importance matrices, UMIA policy
JSON, routing traces, HTTP requests), the harness that runs each input through the real entry point and classifies
the outcome, and the finding records that keep a small reproducer. docs/fuzzing.md describes how to run it.

Not here: fixes (they go where the bug is) and the regression tests (tests/fuzz/).
"""
