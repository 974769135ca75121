"""tierflow's benchmarks: suites that measure it, a library they share, one results folder.

Run a suite from the repository's root as a module, e.g. ``python -m benchmarks.comparison
--quick``; ``python -m benchmarks.SUITE --help`` says what each takes. The suites:

- :mod:`benchmarks.comparison`: tierflow against device-only, cloud-only and single-split
  (``results/RESULTS.md``, ``results.json``, ``results_meta.json`` and its plots);
- :mod:`benchmarks.adaptation`: live plan switching while the uplink drifts;
- :mod:`benchmarks.generation`: a decoder split over three tiers, with and without drafts;
- :mod:`benchmarks.decoder_cost`: a decoder plan's predicted cost against what it measures;
- :mod:`benchmarks.rate_fidelity`, :mod:`benchmarks.bottleneck` and
  :mod:`benchmarks.bottleneck_trained`: bytes against fidelity, learned bottlenecks;
- :mod:`benchmarks.transport`, :mod:`benchmarks.chaos`, :mod:`benchmarks.cache`,
  :mod:`benchmarks.planning`, :mod:`benchmarks.exits`, :mod:`benchmarks.tenancy`: the
  runtime's overheads, limits and isolation;
- :mod:`benchmarks.codec_speed`, :mod:`benchmarks.demo_codecs`,
  :mod:`benchmarks.image_codecs`: the codecs.

:mod:`benchmarks.lib` holds what they share. Every suite writes into ``results/``
(:data:`benchmarks.lib.RESULTS`). Imports are absolute (``from benchmarks.lib import
models``) and never circular; ``tests/benchmarks/test_package.py`` checks both.
"""
