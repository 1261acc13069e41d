"""Labelled traces: a generated corpus of healthy runs and hangs (corpus.py), the messes real logs carry
(perturb.py), a day logged as nvidia-smi logs it (messy_day.py), and how a trace is judged (judge.py).
The tests hold the line on a few traces; the benchmarks under bench/ measure them all."""
